"""`./dmuon bench overlap` end to end on the smallest point (the demo's
char-GPT, 64 tokens, one measured step): real pinned trainer processes, a
real pinned dmuond, the profiling pass, the kernel timing, the bound, the
JSON and the plot. Checks what the harness computes, never how fast
anything is."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bound import Trainer  # noqa: E402
from ns_times import shape_key  # noqa: E402


def _two_cores() -> tuple[int, int]:
    """The trainer's core and dmuond's; the test is skipped without two."""
    if len(os.sched_getaffinity(0)) < 2:
        import pytest

        pytest.skip("needs two cores: one for the trainer, one for dmuond")
    t, d = sorted(os.sched_getaffinity(0))[:2]
    return t, d


def test_smallest_point(tmp_path):
    t, d = _two_cores()
    out = tmp_path / "o.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "run.py"), "--models=char-gpt", "--tokens=64",
         "--optimizers=muon-fp32,dmuon-forward", "--warmup=1", "--steps=1",
         f"--trainer-cpus={t}", f"--daemon-cpus={d}", f"--out={out}",
         f"--trace={tmp_path / 'traces'}"],
        capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["trainer_cpus"] == [t] and res["daemon_cpus"] == [d]
    assert res["git_revision"] and res["machine"]["cores"] >= 2
    assert open(tmp_path / "o.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    (p,) = res["points"]
    assert (p["model"], p["tokens"]) == ("char-gpt", 64)
    # 4 blocks x (qkv, proj, fc, out), in forward order, each in its segment.
    mats = p["profile"]["matrices"]
    assert [m["name"].split(".")[-2] for m in mats] == ["qkv", "proj", "fc", "out"] * 4
    assert [m["segment"] for m in mats] == list(range(1, 17))
    assert len(p["profile"]["forward_s"]) == len(p["profile"]["backward_s"]) == 17
    assert set(p["ns_seconds"]) == {"384x128", "128x128", "512x128", "128x512"}
    probe = p["torch_bf16_probe"]  # torch's own bf16 NS of the smallest shape
    assert probe["shape"] == "128x128" and probe["seconds"] > 0
    assert probe["fp32_seconds"] == p["torch_fp32_ns_seconds"]["128x128"]
    assert "skipped" not in p  # muon-bf16 was not asked for
    # The bound is at least the trainer's work and the daemon's.
    work = Trainer(p["profile"]["forward_s"], p["profile"]["backward_s"],
                   p["profile"]["after_backward_s"]).work()
    assert p["bound_ms"] >= 1000 * work - 1e-6 and p["bound_ms"] >= p["ns_ms"]
    r = p["results"]
    assert set(r) == {"muon-fp32", "dmuon-forward"}
    # DMuon's run: dmuond's own Newton-Schulz per shape from its timeline,
    # and the bound again with them.
    d = r["dmuon-forward"]
    assert set(d["dmuond_ns_seconds"]) == set(p["ns_seconds"])
    assert all(s > 0 for s in d["dmuond_ns_seconds"].values())
    in_run_ns = sum(d["dmuond_ns_seconds"][shape_key(m["shape"])] for m in mats)
    assert d["bound_in_run_ms"] >= 1000 * work - 1e-6
    assert d["bound_in_run_ms"] >= 1000 * in_run_ns - 1e-6
    assert d["vs_bound_in_run"] == d["iteration_ms"] / d["bound_in_run_ms"]
    assert "dmuond_ns_seconds" not in r["muon-fp32"]
    assert set(p["profile_per_step"]) == {"minor_faults", "voluntary_switches",
                                          "involuntary_switches"}
    for kind, x in r.items():
        assert x["iteration_ms"] > 0 and len(x["periods_ms"]) == 1
        assert set(x["per_step"]) == set(p["profile_per_step"])
        assert all(v >= 0 for v in x["per_step"].values())
        assert x["vs_bound"] == x["iteration_ms"] / p["bound_ms"]
        assert len(x["losses"]) == 3
    # The same data and initial weights for everyone; DMuon's Muon is
    # torch's (fp32) to rounding.
    first = r["muon-fp32"]["losses"][0]
    assert r["dmuon-forward"]["losses"][0] == first
    assert r["dmuon-forward"]["loss_rel_diff_vs_muon_fp32"] < 1e-5
    assert r["dmuon-forward"]["final_loss"] != first  # the updates were applied
    # --trace: DMuon's run (and only DMuon's) as one merged timeline, both
    # sides, which `dmuon.trace stages` reads.
    assert os.listdir(tmp_path / "traces") == ["char-gpt-64-dmuon-forward.json"]
    doc = json.loads((tmp_path / "traces" / "char-gpt-64-dmuon-forward.json").read_text())
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert "dmuond" in names and any(n.startswith("trainer") for n in names)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "client", "python"))
    from dmuon import trace

    parts = trace.stages(doc)
    assert parts["ns"] > 0 and parts["handoff"] > 0 and parts["backward"] > 0


def test_emulated_bf16_is_skipped_unless_named():
    import point

    kinds = ["adamw", "muon-bf16", "muon-fp32"]
    slow = {"shape": "128x128", "seconds": 0.5, "fp32_seconds": 0.01, "ratio": 50.0}
    fast = dict(slow, seconds=0.005, ratio=0.5)
    default = point.Setup("0", [1], 1, 1)
    why = point._skipped(default, slow, kinds)["muon-bf16"]
    assert "128x128" in why and "500 ms" in why and "50x" in why
    assert "--optimizers muon-bf16" in why
    assert point._skipped(default, fast, kinds) == {}
    assert point._skipped(default, None, kinds) == {}  # no probe: runs
    assert point._skipped(default, slow, ["adamw"]) == {}
    named = point.Setup("0", [1], 1, 1, bf16_skip_ratio=None)
    assert point._skipped(named, slow, kinds) == {}


def test_naming_muon_bf16_runs_it_anyway():
    import run

    def ratio(*argv):
        return run.parse_args(["--no-pair", *argv])[1].bf16_skip_ratio

    assert ratio() == ratio("--optimizers=adamw,muon-fp32") == 4.0
    assert ratio("--optimizers=adamw,muon-bf16") is None


def test_ns_from_dmuonds_timeline():
    import ns_times

    def ns(step, shape, ms, batch_size=1, stage="ns"):
        return {"ph": "X", "dur": 1000 * ms, "name": f"{stage} w",
                "args": {"stage": stage, "step": step, "shape": shape,
                         "batch_size": batch_size}}

    doc = {"traceEvents": [
        ns(1, "8x4", 100.0),  # warm-up: left out
        ns(2, "8x4", 3.0), ns(3, "8x4", 5.0), ns(4, "8x4", 4.0),
        ns(3, "4x4", 6.0, batch_size=3),  # a batch of 3: a third each
        ns(3, "4x4", 6.0, batch_size=3), ns(3, "4x4", 9.0, batch_size=3),
        ns(3, "8x4", 50.0, stage="gather"),  # not Newton-Schulz
        {"ph": "i", "args": {"stage": "ns", "step": 3, "shape": "8x4"}},
    ]}
    from pytest import approx

    got = ns_times.from_trace(doc, after_step=1)
    assert got == {"4x4": approx(0.002), "8x4": approx(0.004)}
    assert ns_times.from_trace(doc)["8x4"] == approx(0.0045)  # median of 100, 3, 5, 4


def test_paths_smallest(tmp_path):
    """benchmarks/overlap/paths.py at its smallest: both paths timed in one
    process, the Python calls counted; the JSON's fields, not their speed."""
    t, d = _two_cores()
    out = tmp_path / "p.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "paths.py"), "--tokens=64", "--steps=12",
         "--warmup=2", "--repeats=1", f"--trainer-cpus={t}", f"--daemon-cpus={d}",
         "--out", str(out)], capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["command"].startswith("benchmarks/overlap/paths.py --tokens=64")
    assert "--out" not in res["command"] and str(out) not in res["command"]
    assert set(res["python_calls_per_step"]) == {"adamw", "dmuon", "dmuon-forward"}
    assert all(n > 0 for n in res["python_calls_per_step"].values())
    (n,), (f,) = res["native_ms"], res["fallback_ms"]
    assert n > 0 and f > 0
    assert abs(res["native_over_fallback"][0] - n / f) < 1e-9

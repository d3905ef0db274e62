"""`./dmuon bench handoff-py` end to end at its smallest (8 matrices, one
measured step, one repeat): real pinned trainer processes, a real dmuond,
the JSON. Checks what it computes, never how fast anything is."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_smallest_point(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores: one for the trainer, one for dmuond")
    t, d = sorted(os.sched_getaffinity(0))[:2]
    out = tmp_path / "h.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "handoff_py.py"), "--matrices=8,16",
         "--repeats=1", "--steps=1", "--warmup=1", f"--trainer-cpu={t}",
         f"--daemon-cpu={d}", f"--out={out}"],
        capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["command"].startswith("./dmuon bench handoff-py --matrices=8,16")
    assert "--out" not in res["command"]
    assert set(res["points"]) == {"8", "16"}
    for n, p in res["points"].items():
        for opt in ("adamw", "dmuon"):
            (ms,) = p["step_ms"][opt]
            assert ms > 0 and p["median_step_ms"][opt] == ms
            assert p["us_per_matrix"][opt] == pytest.approx(1e3 * ms / int(n))
        assert p["dmuon_minus_adamw_us_per_matrix"] == pytest.approx(
            p["us_per_matrix"]["dmuon"] - p["us_per_matrix"]["adamw"])


def test_a_bad_worker_fails_loudly(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "handoff_py.py"), "--matrices=8",
         "--repeats=1", "--trainer-cpu=100000", f"--out={tmp_path / 'h.json'}"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "worker at 8 matrices failed" in proc.stderr
    assert not (tmp_path / "h.json").exists()

"""The step timeline across processes: a real dmuond with --trace-file and
a trainer with DMUON_TRACE train a few steps; `python -m dmuon.trace merge`
makes one file, and every Muon matrix of every step has its whole chain of
events (trainer: ready, handoff, declare; dmuond: received, queued, gather,
ns, return; trainer: update_received, wait, apply) in causal order across
the two processes, on the trainer's and dmuond's own tracks."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import dmuon
from dmuon import trace as trace_mod
from dmuon.optim import DMuon
from helpers import TinyLM, lm_batch, loss_of

pytestmark = pytest.mark.timeout(120)

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp_path, monkeypatch, steps, **kw):
    """Trains TinyLM `steps` steps with both traces on; returns the merged
    trace (parsed), the Muon entries' names and the trainer's pid."""
    daemon_file, trainer_file = tmp_path / "dmuond.json", tmp_path / "trainer.json"
    d = dmuon.LocalDaemon(flags=[f"--trace-file={daemon_file}"], stop_grace=10.0)
    monkeypatch.setenv("DMUON_TRACE", str(trainer_file))
    torch.manual_seed(int.from_bytes(os.urandom(2), "little"))
    model = TinyLM()
    opt = DMuon(model, lr=0.02, daemon_options=dmuon.DaemonOptions(d.address), **kw)
    for step in range(steps):
        loss_of(model, lm_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()  # overlap_forward: the last step's updates, applied now
    names = [r.name for r in opt._table.muon]
    opt.close()
    d.stop()  # SIGTERM: the daemon ends its file
    merged = tmp_path / "merged.json"
    out = subprocess.run(
        [sys.executable, "-m", "dmuon.trace", "merge", str(merged), str(trainer_file),
         str(daemon_file)], capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=PYTHON_DIR), check=True)
    assert "open it in" in out.stdout
    with open(merged) as f:
        return json.load(f), names, os.getpid(), d.process.pid


def _chains(events):
    """{(job, step, param): {stage: (start_us, end_us, pid)}} of the matrix
    events (each stage once per matrix and step)."""
    chains = {}
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") not in ("X", "i") or "stage" not in a or "param" not in a:
            continue
        key = (a["job"], a["step"], a["param"])
        stage = chains.setdefault(key, {})
        assert a["stage"] not in stage, f"{a['stage']} twice for {key}"
        stage[a["stage"]] = (e["ts"], e["ts"] + e.get("dur", 0.0), e["pid"], a["name"])
    return chains


@pytest.mark.parametrize("overlap_forward", [False, True])
def test_every_matrix_has_its_causal_chain_across_processes(tmp_path, monkeypatch,
                                                            overlap_forward):
    steps = 3
    doc, names, trainer_pid, daemon_pid = _train(
        tmp_path, monkeypatch, steps,
        overlap_options=dmuon.OverlapOptions(forward=overlap_forward))
    events = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    assert procs[daemon_pid] == "dmuond"
    assert procs[trainer_pid].startswith("trainer")
    threads = {(e["pid"], e["args"]["name"]) for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert (daemon_pid, "executor 0") in threads
    chains = _chains(events)
    jobs = {k[0] for k in chains}
    assert len(jobs) == 1
    job = jobs.pop()
    trainer = ("ready", "handoff", "declare", "update_received", "wait", "apply")
    daemon = ("received", "queued", "gather", "ns", "return")
    for step in range(1, steps + 1):
        for param, name in enumerate(names):
            c = chains.get((job, step, param))
            assert c is not None, f"no events of {name} at step {step}"
            assert set(c) == set(trainer + daemon), (name, step, sorted(c))
            for s in trainer:
                assert c[s][2] == trainer_pid and c[s][3] == name, (s, c[s])
            for s in daemon:
                assert c[s][2] == daemon_pid and c[s][3] == name, (s, c[s])
            start = {s: v[0] for s, v in c.items()}
            end = {s: v[1] for s, v in c.items()}
            order = [  # (earlier, later) moments, in microseconds of one clock
                (start["ready"], start["handoff"]), (end["handoff"], start["declare"]),
                (start["declare"], start["received"]),
                (start["received"], start["queued"]), (start["queued"], start["gather"]),
                (end["gather"], start["ns"]), (end["ns"], start["return"]),
                (start["return"], start["update_received"]),
                (start["update_received"], end["wait"]), (end["wait"], start["apply"]),
            ]
            for k, (a, b) in enumerate(order):
                assert a <= b + 1e-3, (name, step, k, order)
            assert start["ns"] < end["ns"], (name, step)
    # The trainer's per-step spans.
    spans = {}
    for e in events:
        if e.get("ph") == "X" and e["pid"] == trainer_pid and "stage" not in (
                e.get("args") or {}):
            spans.setdefault(e["name"], []).append(e)
    for what in ("forward", "backward", "step()", "adamw step"):
        assert len(spans.get(what, ())) == steps, (what, sorted(spans))
    assert any(n.startswith("forward ") for n in spans)  # a module's forward
    # Flows link each matrix's chain: one start and one finish per chain.
    starts = [e for e in events if e.get("ph") == "s"]
    finishes = [e for e in events if e.get("ph") == "f"]
    assert len(starts) == len(finishes) == steps * len(names)
    # The summary: a line per step, and per matrix with its NS time.
    text = trace_mod.summary(doc, matrices=True).splitlines()
    for step in range(1, steps + 1):
        head = [k for k, line in enumerate(text) if line.startswith(f"step {step}: ")]
        assert len(head) == 1, text
        rows = text[head[0] + 2:head[0] + 2 + len(names)]
        for param, name in enumerate(names):
            ns = chains[(job, step, param)]["ns"]
            row = [r for r in rows if r.lstrip().startswith(name + " (")]
            assert len(row) == 1, (name, rows)
            assert f", {(ns[1] - ns[0]) / 1000:.1f} (" in row[0], (row, ns)
    # The stages table: each part's median per step, from the events above.
    parts = trace_mod.stages(doc)
    for stage in ("handoff", "declare", "wait", "apply", "gather", "ns", "return"):
        per_step = sorted(sum(c[stage][1] - c[stage][0] for (j, st, _), c in chains.items()
                              if j == job and st == step and stage in c) / 1000
                          for step in range(1, steps + 1))
        assert parts[stage] == pytest.approx(per_step[steps // 2]), stage
    assert parts["ns"] > 0 and parts["backward"] > 0 and parts["forward"] > 0
    assert parts["check edits"] <= parts["step()"]


def test_stages_are_per_step_medians_of_each_part():
    """stages() on a hand-made trace: per-matrix stages summed within a step,
    the median across steps, 0 for a step without a part; events with no
    step and unknown names are left out."""
    def x(name, step, dur_ms, stage=None):
        args = {"step": step} if step is not None else {}
        if stage:
            args["stage"] = stage
        return {"ph": "X", "name": name, "ts": 0, "dur": dur_ms * 1000, "pid": 1,
                "tid": 1, "args": args}
    events = [x("backward", s, b) for s, b in ((1, 10), (2, 30), (3, 20))]
    events += [x("apply a", 1, 1, "apply"), x("apply b", 1, 2, "apply"),  # 3
               x("apply a", 2, 5, "apply"), x("apply b", 2, 4, "apply"),  # 9
               x("apply a", 3, 7, "apply")]  # 7
    events += [x("ns a", 2, 8, "ns"), x("backward", None, 99), x("noise", 1, 50)]
    parts = trace_mod.stages({"traceEvents": events})
    assert parts["backward"] == 20 and parts["apply"] == 7
    assert parts["ns"] == 0  # steps 1 and 3 had none
    assert parts["forward"] == 0 and set(parts) == set(trace_mod.STEP_PARTS)
    table = trace_mod.stages_table({"before": parts, "after": parts}).splitlines()
    assert table[0] == "| ms per step (median) | before | after |"
    assert "| trainer apply | 7.0 | 7.0 |" in table and "| dmuond ns | 0.0 | 0.0 |" in table
    with pytest.raises(ValueError, match="no step's events"):
        trace_mod.stages({"traceEvents": [x("backward", None, 1)]})


def test_stages_count_a_batch_newton_schulz_once():
    """A batch of matrices (the GPU executors') gives each matrix an "ns"
    span of the whole batch's run: stages() and summary() count it once per
    batch, and batches of other executors or steps each once."""
    def ns(name, step, dur_ms, executor, batch, pid=7):
        return {"ph": "X", "name": "ns " + name, "ts": 0, "dur": dur_ms * 1000,
                "pid": pid, "tid": 1,
                "args": {"step": step, "stage": "ns", "name": name, "executor": executor,
                         "batch": batch, "batch_size": 3}}
    events = [ns(n, 1, 12, 0, 5) for n in ("a", "b", "c")]  # one batch: 12
    events += [ns("d", 1, 4, 1, 5)]  # executor 1's batch 5: 4 more
    events += [ns(n, 2, 10, 0, 6) for n in ("a", "b", "c")]  # step 2: 10
    events += [ns("e", 3, 9, 0, None)]  # a span without a batch id counts
    parts = trace_mod.stages({"traceEvents": events})
    assert parts["ns"] == 10  # the median of 16, 10 and 9
    text = trace_mod.summary({"traceEvents": events})
    assert "dmuond NS 16.0 ms" in text and "dmuond NS 10.0 ms" in text, text


def test_merge_reads_a_file_cut_short(tmp_path):
    """A daemon killed mid-write leaves an array without its end: the merge
    keeps every whole event before the cut."""
    events = [{"ph": "X", "name": f"e{k}", "pid": 7, "tid": 1, "ts": k, "dur": 1}
              for k in range(5)]
    whole = json.dumps({"traceEvents": events})
    cut = whole[:whole.index('"e4"') + 3]  # inside the last event
    path = tmp_path / "cut.json"
    path.write_text(cut)
    doc = trace_mod.load(str(path))
    assert [e["name"] for e in doc["traceEvents"]] == ["e0", "e1", "e2", "e3"]


def test_unwritable_trace_file_is_an_error_naming_the_flag(tmp_path):
    bad = tmp_path / "no" / "such" / "dir" / "t.json"
    with pytest.raises(RuntimeError, match="--trace-file"):
        dmuon.LocalDaemon(flags=[f"--trace-file={bad}"])


CTL = os.path.join(os.path.dirname(os.path.dirname(PYTHON_DIR)), "bazel-bin", "daemon",
                   "dmuonctl")


def _ctl(d, *args, **kw):
    return subprocess.Popen([CTL, f"--server={d.address}", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_dmuonctl_trace_records_a_window_of_a_running_daemon(tmp_path):
    """dmuonctl trace on a daemon without --trace-file: the steps trained
    while it records are in its file, each matrix's daemon stages in order;
    a second trace meanwhile is refused, and the file merges with nothing
    else (one process's tracks)."""
    d = dmuon.LocalDaemon(stop_grace=5.0)
    out = tmp_path / "window.json"
    model = TinyLM()
    opt = DMuon(model, lr=0.02, daemon_options=dmuon.DaemonOptions(d.address))
    ctl = _ctl(d, "trace", f"--out={out}", "--seconds=3")
    step = 0
    try:
        deadline = time.monotonic() + 2.0
        second = None
        while time.monotonic() < deadline:
            loss_of(model, lm_batch(step)).backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if second is None and step == 2:
                second = _ctl(d, "trace", f"--out={tmp_path / 'second.json'}",
                              "--seconds=1")
        _, err2 = second.communicate(timeout=30)
        stdout, err = ctl.communicate(timeout=30)
    finally:
        opt.close()
        d.stop()
    assert ctl.returncode == 0, err
    assert "wrote" in stdout and "dmuon.trace merge" in stdout
    assert second.returncode == 1 and "recording its step timeline already" in err2, err2
    chains = _chains(trace_mod.load(str(out))["traceEvents"])
    complete = [c for c in chains.values()
                if {"received", "queued", "gather", "ns", "return"} <= set(c)]
    assert len(complete) >= len(opt._table.muon), sorted(chains)[:5]
    for c in complete:
        assert c["received"][0] <= c["queued"][0] <= c["gather"][0]
        assert c["gather"][1] <= c["ns"][0] < c["ns"][1] <= c["return"][0]


def test_dmuonctl_trace_refused_while_trace_file_records(tmp_path):
    d = dmuon.LocalDaemon(flags=[f"--trace-file={tmp_path / 'd.json'}"], stop_grace=5.0)
    try:
        ctl = _ctl(d, "trace", f"--out={tmp_path / 'w.json'}", "--seconds=0.1")
        _, err = ctl.communicate(timeout=30)
        bad = _ctl(d, "trace", f"--out={tmp_path / 'w.json'}", "--seconds=0")
        _, err0 = bad.communicate(timeout=30)
    finally:
        d.stop()
    assert ctl.returncode == 1 and "--trace-file" in err, err
    assert bad.returncode == 2 and "--seconds" in err0, err0


def test_tracer_bounded_whole_after_each_flush_and_per_thread(tmp_path, monkeypatch):
    """The trainer's recorder alone: past MAX_PENDING events are dropped and
    counted; the file is whole JSON after every flush, each thread on its
    own named track, its events in its order."""
    import threading

    from dmuon import _trace
    monkeypatch.setattr(_trace, "FLUSH_EVERY", 10**9)
    monkeypatch.setattr(_trace, "MAX_PENDING", 50)
    path = tmp_path / "t.json"
    t = _trace.Tracer(str(path), "trainer test")

    def record(k):
        for j in range(20):
            t.complete(f"e{k}", j, j + 1, {"j": j})

    threads = [threading.Thread(target=record, args=(k,), name=f"w{k}") for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t.flush()
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 50 and doc["otherData"]["dropped_events"] == 30
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    by_tid = {}
    for e in xs:
        by_tid.setdefault(e["tid"], []).append(e)
    for tid, es in by_tid.items():
        assert names[tid] == "w" + es[0]["name"][1:]  # its thread's name
        assert [e["args"]["j"] for e in es] == sorted(e["args"]["j"] for e in es)
    t.instant("later", 5)
    t.flush()
    doc = json.loads(path.read_text())  # whole again, the new event appended
    assert sum(e["ph"] in ("X", "i") for e in doc["traceEvents"]) == 51

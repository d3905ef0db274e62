"""Issue 28, part 2: a trainer killed at random points and restarted at other
world sizes continues exactly, its Muon momentum kept by dmuond as marks.

A 2-rank FSDP2 trainer (crash_worker.py: fsdp_worker's model, DCP
checkpoints every 2 steps in reference mode, so a checkpoint's Muon momentum
is dmuond's mark of its step) is SIGKILLed on every rank five times at
seeded random points: in a backward pass, inside opt.step(), inside
dcp.save. It is restarted alternately on 1 and 4 ranks, each restart loading
the newest complete checkpoint and opening the job with resume=N. Between
two runs dmuond itself is SIGKILLed and restarted on the same --state-dir
(its job and marks must survive). The final parameters equal one
uninterrupted single-process run of torch.optim.Muon (fp32 Newton-Schulz) +
AdamW to 1e-5 per parameter. The seed and the kill points are printed
(DMUON_CRASH_SEED=n reruns one)."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import dmuon
import fsdp_worker
from crash_worker import newest_complete
from helpers import rel_err
from ranks import HERE, free_port
from torch_ref import muon_adamw_run

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")

TOTAL, EVERY = 14, 2
WORLDS = (2, 1, 4, 1, 4, 1)  # the first run, then each restart's
KILL_DAEMON_AFTER = 2  # dmuond is SIGKILLed after this run (0-based)
TOL = 1e-5


def kill_points(rng, kills):
    """One phase per kill, each of the three at least once, in random order."""
    phases = ["backward", "step", "checkpoint"]
    phases += [rng.choice(phases) for _ in range(kills - len(phases))]
    rng.shuffle(phases)
    return phases


def kill_step(rng, start, phase):
    """A step past `start` (the run's resume point) to die at: within the next
    two checkpoints, at least one step trained; for "checkpoint" one that
    ends with a checkpoint (none left: the backward of the last step)."""
    if phase == "checkpoint":
        ends = [s for s in range(start + 1, start + 2 * EVERY + 1)
                if (s + 1) % EVERY == 0 and s + 1 < TOTAL]
        return (rng.choice(ends), phase) if ends else (TOTAL - 1, "backward")
    return rng.randrange(start + 1, min(start + 2 * EVERY + 1, TOTAL)), phase


def run_trainer(world, address, tmp_path, run, kill=""):
    """One run of crash_worker on `world` ranks; with `kill`, SIGKILLs every
    rank once rank 0 signals it reached the point. Returns the ranks' results
    (None when killed) and their output."""
    sig = tmp_path / f"killed-{run}"
    init = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs, outs = [], [str(tmp_path / f"run{run}-{r}.pt") for r in range(world)]
    for rank in range(world):
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "crash_worker.py"), "--mode=crash",
             f"--rank={rank}", f"--world={world}", f"--init={init}",
             f"--server={address}", f"--out={outs[rank]}", f"--ckpt={tmp_path / 'ckpt'}",
             "--job=crash-job", f"--signal={sig}", f"--kill={kill}",
             f"--total={TOTAL}", f"--every={EVERY}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 150
    while not (kill and sig.exists()) and any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    killed = kill and sig.exists()
    for p in procs:
        if killed or p.poll() is None:
            p.send_signal(signal.SIGKILL)
    logs = [p.communicate()[0].decode(errors="replace") for p in procs]
    if kill and not killed:
        pytest.fail(f"run {run} never reached its kill point {kill}:\n" + "\n".join(logs))
    if killed:
        return None, logs
    results = []
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and os.path.exists(out), f"rank {rank}:\n{logs[rank]}"
        r = torch.load(out, weights_only=False)
        assert r["error"] is None, f"rank {rank}: {r['error']}\n{logs[rank]}"
        results.append(r)
    return results, logs


def reference():
    """One uninterrupted single-process run of torch.optim.Muon (fp32
    Newton-Schulz) + AdamW, the whole batch of every step."""
    def grads_of(model, s):
        x, y = fsdp_worker.batch(s)
        ((model(x) - y) ** 2).mean().backward()

    steps, _, _ = muon_adamw_run(fsdp_worker.make_model(), ("0.weight", "2.weight",
                                                            "4.weight"), TOTAL, grads_of)
    return steps[-1]


def start_daemon(state_dir):
    # --marks-per-job: room for every checkpoint's mark, so that which mark a
    # full job drops (the daemon's concern, server/mark_store_test) cannot
    # decide this test.
    return dmuon.LocalDaemon(flags=[f"--state-dir={state_dir}", "--marks-per-job=16"],
                             stop_grace=5.0)


def test_killed_at_random_points_resumes_exactly_at_any_world_size(tmp_path):
    seed = int(os.environ.get("DMUON_CRASH_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    phases = kill_points(rng, len(WORLDS) - 1)
    (tmp_path / "ckpt").mkdir()
    state_dir = tmp_path / "state"
    d = start_daemon(state_dir)
    plan = []
    try:
        for run, world in enumerate(WORLDS):
            start = newest_complete(tmp_path / "ckpt")
            kill = ""
            if run < len(phases):
                kill = "%d:%s" % kill_step(rng, start, phases[run])
            plan.append((world, start, kill))
            print(f"seed {seed}: run {run} on {world} ranks from step {start}, "
                  f"kill at {kill or 'none'}", flush=True)
            results, logs = run_trainer(world, d.address, tmp_path, run, kill)
            if run == KILL_DAEMON_AFTER:
                d.process.send_signal(signal.SIGKILL)
                d.process.wait(30)
                d.stop()
                d = start_daemon(state_dir)
    finally:
        d.stop()
    assert all(r["start"] == plan[-1][1] for r in results)
    want = reference()
    for rank, r in enumerate(results):
        for name, p in want.items():
            err = rel_err(r["params"][name], p)
            assert err < TOL, f"seed {seed} {plan}: rank {rank} {name}: {err:.2e}"

"""Multi-process torch.distributed jobs for the tests: `launch` starts one
real process per rank of a worker script (gloo on 127.0.0.1, one dmuond),
`worker_main` is the worker side. Each rank writes a dict to its --out file
({"error": None or "Type: message", ...what the worker returns})."""

import argparse
import os
import socket
import subprocess
import sys
import traceback

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker, mode, world, address, tmp_path, extra=(), timeout=120, check=True):
    """Runs `worker` (a script beside this file) on `world` ranks; returns
    (each rank's dict, each rank's output). check: fail the test when a rank
    reported an error (else the caller inspects "error")."""
    init = f"tcp://127.0.0.1:{free_port()}"
    # Unbuffered, and faulthandler: a rank that aborts (SIGABRT from a C++
    # std::terminate, SIGSEGV) still shows what it printed and where its
    # Python threads were.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1")
    procs, outs = [], []
    for rank in range(world):
        out = str(tmp_path / f"{mode}-{rank}.pt")
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, worker), f"--mode={mode}",
             f"--rank={rank}", f"--world={world}", f"--init={init}",
             f"--server={address}", f"--out={out}", *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{worker} {mode}: a rank hung")
    results = []
    for rank, (p, out) in enumerate(zip(procs, outs)):
        if p.returncode != 0 or not os.path.exists(out):
            how = (f"killed by signal {-p.returncode}" if p.returncode < 0
                   else f"exit code {p.returncode}")
            when = ("after it wrote its result (in teardown)" if os.path.exists(out)
                    else "without writing its result")
            pytest.fail(f"{worker} {mode} rank {rank}: {how}, {when}:\n{logs[rank]}")
        r = torch.load(out, weights_only=False)
        if check:
            assert r["error"] is None, f"{mode} rank {rank}: {r['error']}\n{logs[rank]}"
        results.append(r)
    return results, logs


def worker_args():
    """The arguments launch() passes; a worker adds its own."""
    ap = argparse.ArgumentParser()
    for name in ("--mode", "--init", "--server", "--out"):
        ap.add_argument(name, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    return ap


def worker_main(args, run, initial=None):
    """Joins the gloo group, runs run(args) -> dict and writes it, over
    `initial`, with "error" (None, or the exception, also printed) to
    args.out; then exits the process (os._exit(0), see below)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank,
                            world_size=args.world)
    result = dict(initial or {}, error=None)
    try:
        result.update(run(args))
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    torch.save(result, args.out)
    dist.destroy_process_group()
    # Then leave without finalizing the interpreter. gloo's worker threads
    # outlive destroy_process_group (they are joined when the last reference
    # to the group goes; FSDP2 and DMuon hold one), and one still freeing its
    # last collective's tensors while the interpreter finalizes takes the GIL
    # and is killed: std::terminate, "terminate called without an active
    # exception" (torch's: CI's test_dcp failed so once; a core of it,
    # reproduced under load: ProcessGroupGloo::runLoop ->
    # ~AsyncAllgatherCoalescedWork -> THPVariable_dealloc ->
    # PyEval_RestoreThread -> pthread_exit). The result is written; a
    # private dmuond (server="auto") dies with its parent (PDEATHSIG).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

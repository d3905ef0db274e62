"""./dmuon bench handoff-py: what the Python client adds per matrix, at many
matrices. A model of N bias-free 8x8 Linear layers (so that forward,
backward and Newton-Schulz cost next to nothing and a step is all
per-matrix bookkeeping), trained with AdamW and with DMuon (default
overlap) against a dmuond of its own; the trainer pinned to --trainer-cpu
with one torch thread, dmuond to --daemon-cpu with one executor and one
thread. Each (optimizer, N, repeat) runs in a fresh process; per step the
median of --steps after --warmup, then the median over --repeats. The
difference DMuon - AdamW per matrix is the client's hand-off, apply and
Ctrl-C guards (the C++ side's share is `./dmuon bench handoff`'s).

A/B of two checkouts: run it with PYTHONPATH at each one's client/python
(the extension and dmuond from $DMUON_EXTENSION_DIR and $DMUON_DMUOND).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

# The checkout's dmuon package, after $PYTHONPATH (which may name another
# checkout's, for an A/B).
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "client", "python"))

def worker(n: int, optimizer: str, steps: int, warmup: int, trainer_cpu: int,
           daemon_cpu: int) -> float:
    """One process's median seconds per step."""
    os.sched_setaffinity(0, [daemon_cpu])  # dmuond inherits it
    import torch

    import dmuon
    from dmuon.optim import DMuon

    torch.set_num_threads(1)
    daemon = None
    if optimizer == "dmuon":
        daemon = dmuon.LocalDaemon(flags=["--cpu-executors=1", "--cpu-threads=1"])
    os.sched_setaffinity(0, [trainer_cpu])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(n)])
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = DMuon(model, lr=1e-3, daemon_options=dmuon.DaemonOptions(server=daemon.address))
    x = torch.randn(4, 8)
    times = []
    try:
        for k in range(warmup + steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            model(x).square().mean().backward()
            opt.step()
            if k >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        if optimizer == "dmuon":
            opt.close()
            daemon.stop()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--matrices", default="512,2048", help="comma list of N (512,2048)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--trainer-cpu", type=int, default=0)
    ap.add_argument("--daemon-cpu", type=int, default=1)
    ap.add_argument("--out", help="JSON results path")
    ap.add_argument("--worker", nargs=2, metavar=("N", "OPTIMIZER"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(worker(int(a.worker[0]), a.worker[1], a.steps, a.warmup, a.trainer_cpu,
                     a.daemon_cpu))
        return
    points = {}
    for n in [int(x) for x in a.matrices.split(",")]:
        runs = {"adamw": [], "dmuon": []}
        for r in range(a.repeats):
            for opt in ("adamw", "dmuon") if r % 2 == 0 else ("dmuon", "adamw"):
                proc = subprocess.run(
                    [sys.executable, __file__, "--worker", str(n), opt,
                     f"--steps={a.steps}", f"--warmup={a.warmup}",
                     f"--trainer-cpu={a.trainer_cpu}", f"--daemon-cpu={a.daemon_cpu}"],
                    capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.exit(f"handoff_py: the {opt} worker at {n} matrices failed "
                             f"(exit {proc.returncode}):\n{proc.stderr}")
                runs[opt].append(float(proc.stdout.strip().splitlines()[-1]) * 1e3)
        med = {k: statistics.median(v) for k, v in runs.items()}
        points[str(n)] = {
            "step_ms": runs, "median_step_ms": med,
            "us_per_matrix": {k: 1e3 * v / n for k, v in med.items()},
            "dmuon_minus_adamw_us_per_matrix": 1e3 * (med["dmuon"] - med["adamw"]) / n}
        print(f"{n:6d} matrices: AdamW {med['adamw']:.1f} ms/step, DMuon {med['dmuon']:.1f}; "
              f"DMuon - AdamW {points[str(n)]['dmuon_minus_adamw_us_per_matrix']:.1f} µs a matrix")
    if a.out:
        doc = {"benchmark": "handoff-py", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "command": "./dmuon bench handoff-py " + " ".join(
                   x for x in sys.argv[1:] if not x.startswith("--out")),
               "machine": {"cpu": platform.processor() or platform.machine(),
                           "cores": os.cpu_count(), "python": platform.python_version()},
               "statistic": "per step: median of --steps; then the median over --repeats",
               "points": points}
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()

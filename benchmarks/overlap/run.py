"""./dmuon bench overlap: how much of dmuond's Newton-Schulz a real PyTorch
trainer hides, against the critical-path bound of the same measured work.

The trainer (one process per optimizer, pinned to --trainer-cpus with one
torch thread per core) and dmuond (pinned to --daemon-cpus, one executor and
one OpenBLAS thread per core) never share a core. For each point (a model
and tokens per step) every optimizer trains the same model from the same
weights on the same batches; the figures are the median iteration after
warm-up, the bound (bound.py) from the point's own layer times
(layer_times.py) and Newton-Schulz times (ns_times.py), and each Muon
variant's final loss against fp32-NS torch.optim.Muon's. Two trainers
sharing the trainer cores and one dmuond are measured at the middle point
of the 4-layer model. benchmarks/README.md ("Overlap") explains the
figures; --quick measures only the 4-layer d=384 model at 1024 tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import optimizers  # noqa: E402
import report  # noqa: E402
import rounds  # noqa: E402
from models import ROOT, model_spec  # noqa: E402
from point import Setup, measure  # noqa: E402
from trainer import parse_cpus  # noqa: E402

# (model, tokens per step): NS on one core from about 2x (fewest tokens) to
# about 0.5x (most) of forward + backward on the other, for each model.
SWEEP = (("gpt-4l-384", (384, 1024, 1536)), ("gpt-8l-384", (1024,)),
         ("char-gpt", (256, 1024)))
QUICK = (("gpt-4l-384", (1024,)),)
QUICK_KINDS = ("adamw", "muon-fp32", "dmuon", "dmuon-forward")
PAIR_AT = ("gpt-4l-384", 1024)
PAIR_KINDS = ("adamw", "dmuon", "dmuon-forward")


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    # What changes the kernels' threads and the hand-off path (DMUON_DOORBELL=0:
    # Step messages instead of the shm doorbell).
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("OPENBLAS_", "OMP_", "MKL_")) or k == "DMUON_DOORBELL"}
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(), "env": env}


def git_revision() -> str:
    def git(*a):
        return subprocess.run(["git", "-C", ROOT, *a], capture_output=True,
                              text=True).stdout.strip()
    rev = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return rev + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="./dmuon bench overlap",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer-cpus", default="0", help="the trainers' cores (0)")
    ap.add_argument("--daemon-cpus", default="1", help="dmuond's cores (1)")
    ap.add_argument("--quick", action="store_true",
                    help="only gpt-4l-384 at 1024 tokens: AdamW, fp32-NS torch Muon, "
                    "DMuon default and overlap_forward (writes out/overlap/ unless --out)")
    ap.add_argument("--models", help="comma list of models (default: the sweep's)")
    ap.add_argument("--tokens", help="comma list of tokens per step, for every model")
    ap.add_argument("--optimizers", help="comma list (default: all; --quick: 4): "
                    + ", ".join(optimizers.LABELS))
    ap.add_argument("--no-pair", action="store_true", help="skip the two-trainer runs")
    ap.add_argument("--trace", metavar="DIR",
                    help="each DMuon run's merged step timeline (trainer and dmuond) "
                         "into DIR/<model>-<tokens>-<optimizer>.json; compare two "
                         "with `python -m dmuon.trace stages A.json B.json`")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps (2)")
    ap.add_argument("--steps", type=int, default=6, help="measured steps (6)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure each point this many times in a row, each round with "
                         "its own bound; the point's ratios are the medians of the "
                         "rounds' (rounds.py) (1)")
    ap.add_argument("--out", help="the JSON (default benchmarks/results/overlap-cpu.json"
                    "; --quick: out/overlap/overlap-quick.json); the plot beside it")
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        ap.error("--warmup, --steps and --rounds must be >= 1")
    try:
        tcpus = parse_cpus(args.trainer_cpus, "--trainer-cpus")
        dcpus = parse_cpus(args.daemon_cpus, "--daemon-cpus")
        if set(tcpus) & set(dcpus):
            raise ValueError(f"--trainer-cpus={args.trainer_cpus} and --daemon-cpus="
                             f"{args.daemon_cpus} share core(s) "
                             f"{sorted(set(tcpus) & set(dcpus))}")
        sweep = QUICK if args.quick else SWEEP
        if args.models:
            sweep = tuple((m, dict(SWEEP).get(m, (1024,)))
                          for m in args.models.split(","))
            for m, _ in sweep:
                model_spec(m)
        if args.tokens:
            tokens = tuple(int(t) for t in args.tokens.split(","))
            sweep = tuple((m, tokens) for m, _ in sweep)
        kinds = optimizers.check_kinds(args.optimizers.split(",")) if args.optimizers \
            else list(QUICK_KINDS if args.quick else optimizers.LABELS)
    except ValueError as e:
        ap.error(str(e))
    out = args.out or (os.path.join(ROOT, "out", "overlap", "overlap-quick.json")
                       if args.quick else
                       os.path.join(ROOT, "benchmarks", "results", "overlap-cpu.json"))
    pair = not (args.quick or args.no_pair)
    # muon-bf16 named: it runs even where its bf16 products are emulated.
    named_bf16 = bool(args.optimizers) and "muon-bf16" in kinds
    setup = Setup(args.trainer_cpus, dcpus, args.warmup, args.steps,
                  trace_dir=os.path.abspath(args.trace) if args.trace else None,
                  bf16_skip_ratio=None if named_bf16 else Setup.bf16_skip_ratio)
    return args, setup, sweep, kinds, out, pair


def _round_tag(k: int, n: int) -> str:
    return f"[round {k + 1}/{n}] " if n > 1 else ""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args, setup, sweep, kinds, out, pair = parse_args(argv)
    # The tree measured: read before the run (a commit during it is not it).
    t0, load0, revision = time.perf_counter(), os.getloadavg(), git_revision()
    points = []
    for model, tokens_list in sweep:
        for tokens in tokens_list:
            pair_kinds = [k for k in PAIR_KINDS if k in kinds] \
                if pair and (model, tokens) == PAIR_AT else []
            points.append(rounds.combine([
                measure(setup, model, tokens, kinds, pair_kinds,
                        log=lambda s, k=k: print(_round_tag(k, args.rounds) + s,
                                                 flush=True))
                for k in range(args.rounds)]))
    res = {
        "benchmark": "overlap-cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["./dmuon bench overlap", *argv]),
        "git_revision": revision, "machine": machine(),
        "load_average": {"start": load0, "end": os.getloadavg()},
        "trainer_cpus": parse_cpus(args.trainer_cpus, "--trainer-cpus"),
        "daemon_cpus": setup.daemon_cpus, "warmup": setup.warmup, "steps": setup.steps,
        "rounds": args.rounds,
        "statistic": "median of the measured steps' periods (step start to step start)"
                     + ("; with rounds, each figure the median over the rounds and "
                        "each ratio the median of the rounds' own" if args.rounds > 1 else ""),
        "optimizers": {k: optimizers.LABELS[k] for k in kinds},
        "points": points, "seconds": time.perf_counter() - t0,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    png = os.path.splitext(out)[0] + ".png"
    report.plot(res, png)
    print()
    print(report.tables(res))
    print(f"wrote {os.path.relpath(out)} and {os.path.relpath(png)} ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()

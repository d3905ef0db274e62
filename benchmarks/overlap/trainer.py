"""One trainer of `./dmuon bench overlap`, in a process of its own: pinned
to --cpus with one torch thread per core, it trains a fresh model with one
optimizer on the point's batches and writes what it measured to --out.

  --mode run      iteration times: the period from one step's start to the
                  next's (so DMuon's overlap_forward, whose step() returns at
                  once and whose wait is in the next forward, is timed the
                  same as the others), after --warmup steps; the losses.
  --mode profile  the critical-path simulation's inputs (layer_times.py):
                  per-segment forward and backward times with hooks, under
                  AdamW on the non-Muon parameters and each matrix's update
                  applied before its forward (what any Muon trainer does).

The process pins itself before torch is imported, so every thread torch
starts inherits the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse_cpus(text: str, flag: str) -> list[int]:
    """'0', '0,2' or '0-3' -> the cores; a clear error naming the flag."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"{flag}={text!r}: expected cores like 0, 0,2 or 0-3") from None
    have = os.sched_getaffinity(0)
    bad = [c for c in cpus if c not in have]
    if not cpus or bad:
        raise ValueError(f"{flag}={text!r}: core(s) {bad or '(none)'} not available "
                         f"(this process may use {sorted(have)})")
    return sorted(set(cpus))


def pin(cpus: list[int]) -> None:
    """This process (and every thread it starts from now on) on `cpus`."""
    os.sched_setaffinity(0, cpus)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(len(cpus))


def run(model, opt, batches, warmup: int) -> dict:
    """Trains on every batch; the periods of the steps after `warmup`
    (the last batch only closes the last measured period)."""
    import torch

    marks, losses, usage = [], [], []
    for x, y in batches:
        marks.append(time.perf_counter())
        usage.append(step_usage())
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                 y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    periods = [b - a for a, b in zip(marks, marks[1:])][warmup:]
    return {"iteration_ms": 1000 * statistics.median(periods),
            "periods_ms": [1000 * p for p in periods], "losses": losses,
            "final_loss": losses[-1], "per_step": usage_per_step(usage, warmup)}


def step_usage() -> tuple[int, int, int]:
    """This process's minor page faults and voluntary and involuntary
    context switches so far (all its threads)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_nvcsw, r.ru_nivcsw


def usage_per_step(usage: list[tuple[int, int, int]], warmup: int) -> dict:
    """Medians over the steps after `warmup` of step_usage()'s deltas from
    one step's start to the next's."""
    deltas = [[b - a for a, b in zip(u, v)] for u, v in zip(usage, usage[1:])][warmup:]
    names = ("minor_faults", "voluntary_switches", "involuntary_switches")
    return {n: statistics.median(d[i] for d in deltas) for i, n in enumerate(names)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--mode", choices=("run", "profile"), default="run")
    ap.add_argument("--cpus", required=True, help="cores, e.g. 0 or 0-3")
    ap.add_argument("--server", default=None, help="host:port of dmuond (DMuon kinds)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="the JSON written")
    args = ap.parse_args(argv)
    cpus = parse_cpus(args.cpus, "--cpus")
    pin(cpus)
    import torch

    torch.set_num_threads(len(cpus))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import models
    import optimizers

    spec = models.model_spec(args.model)
    corpus = models.char_gpt.Corpus()
    # One batch more than the steps timed: it closes the last period.
    data = models.batches(corpus, args.tokens, args.warmup + args.steps + 1)
    model = models.build(spec, corpus, args.seed)
    t0 = time.perf_counter()
    if args.mode == "profile":
        import layer_times

        result = layer_times.profile(model, data, args.warmup)
    else:
        opt = optimizers.make(args.optimizer, model, args.server)
        try:
            result = run(model, opt, data, args.warmup)
        finally:
            if hasattr(opt, "close"):
                opt.close()
    result.update(optimizer=args.optimizer, mode=args.mode, cpus=cpus,
                  threads=torch.get_num_threads(), seconds=time.perf_counter() - t0)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

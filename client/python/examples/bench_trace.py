"""The step timeline's cost: the demo's char-GPT trained with DMuon and a
private dmuond, with tracing off and on (DMUON_TRACE for the trainer, which
gives the private dmuond --trace-file too), in alternating runs; the
iteration's median per run, then the median over runs of each, and their
ratio. Writes benchmarks/results/trace-overhead.json, and a merged timeline
of a few steps (--example, default benchmarks/results/trace-example.json).

    .venv/bin/python client/python/examples/bench_trace.py [--repeats 5]
"""

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch

import char_gpt
from dmuon import _trace, trace

RESULTS = os.path.join(char_gpt.HERE, "..", "..", "..", "benchmarks", "results")


def run(corpus, steps, warmup, trace_path):
    """One training run; trace_path None: tracing off. Returns the median
    iteration (ms) of the measured steps."""
    if trace_path is None:
        os.environ.pop("DMUON_TRACE", None)
    else:
        os.environ["DMUON_TRACE"] = trace_path
    try:
        r = char_gpt.train("dmuon", corpus, warmup + steps)
    finally:
        os.environ.pop("DMUON_TRACE", None)
    return 1000 * statistics.median(r["iter_seconds"][warmup:])


def example(corpus, steps, path, tmp):
    """A merged timeline of `steps` steps (trainer and its private dmuond)."""
    trainer = os.path.join(tmp, "example.json")
    run(corpus, steps, 0, trainer)
    docs = [trace.load(trainer), trace.load(_trace.daemon_trace_path(trainer))]
    with open(path, "w") as f:
        json.dump(trace.merge(docs), f)
    print(f"wrote {os.path.relpath(path)} ({os.path.getsize(path) // 1024} KB)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each (alternating)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "trace-overhead.json"))
    ap.add_argument("--example", default=os.path.join(RESULTS, "trace-example.json"),
                    help="the merged example timeline written ('' for none)")
    ap.add_argument("--example-steps", type=int, default=3)
    args = ap.parse_args()
    corpus = char_gpt.Corpus(device="cpu")
    t0 = time.perf_counter()
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            # Alternating, and which goes first alternates too.
            for traced in ((False, True) if k % 2 == 0 else (True, False)):
                path = os.path.join(tmp, f"run{k}.json") if traced else None
                ms = run(corpus, args.steps, args.warmup, path)
                (on if traced else off).append(ms)
                print(f"  run {k} tracing {'on ' if traced else 'off'} {ms:7.1f} ms/step",
                      flush=True)
        if args.example:
            example(corpus, args.example_steps, args.example, tmp)
    m_off, m_on = statistics.median(off), statistics.median(on)
    print(f"tracing off {m_off:.1f} ms/step, on {m_on:.1f} ms/step: ratio {m_on / m_off:.3f}")
    out = {"benchmark": "trace-overhead", "model": "char_gpt.GPT (demo)",
           "host": platform.node(), "cpus": os.cpu_count(),
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
           "statistic": "median iteration over a run's measured steps, then median "
                        "over runs; runs alternate off/on",
           "off_ms": m_off, "on_ms": m_on, "ratio": m_on / m_off,
           "runs_off_ms": off, "runs_on_ms": on, "seconds": time.perf_counter() - t0}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()

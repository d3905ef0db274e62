"""The step timeline's cost: the demo's char-GPT trained with DMuon and a
private dmuond, with tracing off and on (DMUON_TRACE for the trainer, which
gives the private dmuond --trace-file too), in alternating runs; the
iteration's median per run, then the median over runs of each, and their
ratio; and, less sensitive to other processes on the machine, the CPU
seconds per step of the trainer (this process) and of dmuond (the private
daemon, a reaped child), and the trainer's cost of one recorded event.
Writes benchmarks/results/trace-overhead.json, and a merged timeline of a
few steps (--example, default benchmarks/results/trace-example.json).

    .venv/bin/python client/python/examples/bench_trace.py [--repeats 5]
"""

import argparse
import json
import os
import platform
import resource
import statistics
import tempfile
import time

import torch

import char_gpt
from dmuon import _trace, trace

RESULTS = os.path.join(char_gpt.HERE, "..", "..", "..", "benchmarks", "results")


def run(corpus, steps, warmup, trace_path):
    """One training run; trace_path None: tracing off. Returns the median
    iteration (ms) of the measured steps, and the trainer's and dmuond's CPU
    ms per step over the whole run (construction included, alike in both)."""
    if trace_path is None:
        os.environ.pop("DMUON_TRACE", None)
    else:
        os.environ["DMUON_TRACE"] = trace_path
    cpu0 = time.process_time()
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        r = char_gpt.train("dmuon", corpus, warmup + steps)
    finally:
        os.environ.pop("DMUON_TRACE", None)
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    n = warmup + steps
    trainer = 1000 * (time.process_time() - cpu0) / n
    daemon = 1000 * ((kids1.ru_utime + kids1.ru_stime) -
                     (kids0.ru_utime + kids0.ru_stime)) / n
    return 1000 * statistics.median(r["iter_seconds"][warmup:]), trainer, daemon


def event_cost_us(tmp, n=200_000):
    """The trainer's cost of one recorded matrix event, its file writes
    included (microseconds)."""
    t = _trace.Tracer(os.path.join(tmp, "events.json"), "bench")
    args = {"stage": "apply", "job": "j", "step": 1, "param": 3, "name": "w", "shape": "4x4"}
    t0 = time.perf_counter()
    for k in range(n):
        t.complete("apply w", k, k + 1, dict(args))
    t.flush()
    return 1e6 * (time.perf_counter() - t0) / n


def example(corpus, steps, path, tmp):
    """A merged timeline of `steps` steps (trainer and its private dmuond)."""
    trainer = os.path.join(tmp, "example.json")
    run(corpus, steps, 0, trainer)  # its timings are not used
    docs = [trace.load(trainer), trace.load(_trace.daemon_trace_path(trainer))]
    with open(path, "w") as f:
        json.dump(trace.merge(docs), f)
    print(f"wrote {os.path.relpath(path)} ({os.path.getsize(path) // 1024} KB)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each (alternating)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "trace-overhead.json"),
                    help="the JSON of the on/off figures")
    ap.add_argument("--example", default=os.path.join(RESULTS, "trace-example.json"),
                    help="the merged example timeline written ('' for none)")
    ap.add_argument("--example-steps", type=int, default=3,
                    help="steps of the example timeline")
    args = ap.parse_args()
    corpus = char_gpt.Corpus(device="cpu")
    t0 = time.perf_counter()
    runs = {False: [], True: []}  # traced -> [(wall, trainer cpu, daemon cpu)]
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            # Alternating, and which goes first alternates too.
            for traced in ((False, True) if k % 2 == 0 else (True, False)):
                path = os.path.join(tmp, f"run{k}.json") if traced else None
                r = run(corpus, args.steps, args.warmup, path)
                runs[traced].append(r)
                print(f"  run {k} tracing {'on ' if traced else 'off'} {r[0]:7.1f} ms/step, "
                      f"CPU trainer {r[1]:6.1f} dmuond {r[2]:6.1f} ms/step", flush=True)
        per_event = event_cost_us(tmp)
        if args.example:
            example(corpus, args.example_steps, args.example, tmp)
    med = {t: [statistics.median(r[i] for r in runs[t]) for i in range(3)] for t in runs}
    ratios = [med[True][i] / med[False][i] for i in range(3)]
    print(f"tracing off/on: wall {med[False][0]:.1f}/{med[True][0]:.1f} ms/step "
          f"(x{ratios[0]:.3f}); CPU trainer {med[False][1]:.1f}/{med[True][1]:.1f} "
          f"(x{ratios[1]:.3f}); CPU dmuond {med[False][2]:.1f}/{med[True][2]:.1f} "
          f"(x{ratios[2]:.3f}); one trainer event {per_event:.2f} us")
    out = {"benchmark": "trace-overhead", "model": "char_gpt.GPT (demo)",
           "host": platform.node(), "cpus": os.cpu_count(),
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
           "statistic": "median iteration over a run's measured steps, then median "
                        "over runs; runs alternate off/on",
           "load_average_at_end": os.getloadavg(),
           "wall_ms": {"off": med[False][0], "on": med[True][0], "ratio": ratios[0]},
           "trainer_cpu_ms_per_step": {"off": med[False][1], "on": med[True][1],
                                       "ratio": ratios[1]},
           "dmuond_cpu_ms_per_step": {"off": med[False][2], "on": med[True][2],
                                      "ratio": ratios[2]},
           "trainer_event_us": per_event,
           "runs": {"off": runs[False], "on": runs[True]},
           "seconds": time.perf_counter() - t0}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()

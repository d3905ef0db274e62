"""DMuon's trainer-side paths, measured where the bench overlap sweep cannot
resolve them (its runs differ by more than the effect): one trainer process
pinned to --trainer-cpus, a private dmuond on --daemon-cpus, one model.

  paired     alternating pairs of steps with DMuon's native per-matrix calls
             (Session.hand_off: copy and declare in one call; apply_update:
             the update written by torch's ops called from C++) and with the
             torch/Python path DMuon takes for anything else (torch's copy_
             into the buffer, then the declaration; the write under
             deferred_sigint). The second step of each pair is timed, so its
             hand-off and the applies in its forward (overlap_forward) both
             took the path. Each repeat's figure is the median over its
             pairs; the ratio is native / fallback within one repeat.
  calls      Python calls (sys.setprofile: Python functions and C functions
             called from Python) in one step after warm-up, for AdamW and
             both DMuon overlaps: deterministic where timings are not.

  .venv/bin/python benchmarks/overlap/paths.py --out FILE.json

Numbers only; nothing is asserted about them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import processes  # noqa: E402
import run  # noqa: E402
import trainer  # noqa: E402


def _step(model, opt, batch) -> float:
    import torch

    x, y = batch
    t0 = time.perf_counter()
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()
    return time.perf_counter() - t0


def paired(model, opt, batches, steps: int, warmup: int) -> dict:
    """Median step (s) with each path, over `steps` steps in pairs."""
    from dmuon import _handoff

    h = opt._handoff
    native = (_handoff._host_float32, h.apply_update)
    fallback = (lambda t: False, h.write_deferred)
    times: dict[str, list[float]] = {"native": [], "fallback": []}
    try:
        for s in range(steps):
            kind = "native" if (s // 2) % 2 == 0 else "fallback"
            _handoff._host_float32, h.apply_update = native if kind == "native" else fallback
            dt = _step(model, opt, batches[s % len(batches)])
            if s >= warmup and s % 2 == 1:
                times[kind].append(dt)
    finally:
        _handoff._host_float32, h.apply_update = native
    return {k: statistics.median(v) for k, v in times.items()}


def python_calls(model, opt, batches) -> int:
    """Python and C functions called from Python in one step (the third)."""
    count = [0]

    def prof(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1

    for s in range(3):
        if s == 2:
            sys.setprofile(prof)
        try:
            _step(model, opt, batches[s])
        finally:
            sys.setprofile(None)
    return count[0]


def _without_out(args: list[str]) -> list[str]:
    """The arguments but --out and its value (either form)."""
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            kept.append(a)
    return kept


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="char-gpt")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300, help="per repeat, in pairs")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trainer-cpus", default="0")
    ap.add_argument("--daemon-cpus", default="1")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    tcpus = trainer.parse_cpus(args.trainer_cpus, "--trainer-cpus")
    dcpus = trainer.parse_cpus(args.daemon_cpus, "--daemon-cpus")
    daemon = processes.start_daemon(dcpus)
    trainer.pin(tcpus)
    import torch

    torch.set_num_threads(len(tcpus))
    import models
    import optimizers

    spec, corpus = models.model_spec(args.model), models.char_gpt.Corpus()
    batches = models.batches(corpus, args.tokens, 8)
    result = {"benchmark": "overlap-paths", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "benchmarks/overlap/paths.py " + " ".join(
                  _without_out(argv if argv is not None else sys.argv[1:])),
              "git_revision": run.git_revision(), "machine": run.machine(),
              "model": args.model, "tokens": args.tokens, "steps": args.steps,
              "trainer_cpus": tcpus, "daemon_cpus": dcpus}
    try:
        calls = {}
        for kind in ("adamw", "dmuon", "dmuon-forward"):
            model = models.build(spec, corpus, 0)
            opt = optimizers.make(kind, model, daemon.address)
            calls[kind] = python_calls(model, opt, batches)
            if hasattr(opt, "close"):
                opt.close()
        model = models.build(spec, corpus, 0)
        opt = optimizers.make("dmuon-forward", model, daemon.address)
        reps = [paired(model, opt, batches, args.steps, args.warmup)
                for _ in range(args.repeats)]
        opt.close()
    finally:
        daemon.stop()
    ratios = [r["native"] / r["fallback"] for r in reps]
    result.update(
        python_calls_per_step=calls,
        native_ms=[1e3 * r["native"] for r in reps],
        fallback_ms=[1e3 * r["fallback"] for r in reps],
        native_over_fallback=ratios, native_over_fallback_median=statistics.median(ratios))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{args.model}, {args.tokens} tokens, overlap_forward: native "
          f"{statistics.median(result['native_ms']):.2f} ms, fallback "
          f"{statistics.median(result['fallback_ms']):.2f} ms a step, native/fallback "
          f"{result['native_over_fallback_median']:.3f} (each of {args.repeats}: "
          + ", ".join(f"{r:.3f}" for r in ratios) + "); Python calls a step: "
          + ", ".join(f"{k} {v}" for k, v in calls.items()))


if __name__ == "__main__":
    main()

"""What a reference checkpoint saves (issue 28 part 2): a 4-layer d=384
char-GPT's DMuon state checkpointed with torch.save and with dcp.save, in
DaemonOptions(checkpoint_momentum="full") (dmuond's momentum in the
checkpoint) and "reference" (each Muon parameter's step only; the momentum
stays on dmuond as the mark of the step).

    .venv/bin/python benchmarks/checkpoint_ref.py [--runs 7] [--out FILE]

A private dmuond (this checkout's, on 127.0.0.1) holds two jobs of the
same model, one per mode; the whole is run twice, against a dmuond without
--state-dir (marks in memory) and one with it (each mark written and
fsynced before state_dict() returns: in both modes, as both mark). Each checkpoint follows a training step (so
every checkpoint marks a new step, as a training loop's would) and is
timed whole: state_dict() (its Mark and, in full mode, its GetState) plus
torch.save to a file, or plus dcp.save to a directory (one process, no process group). Reported: the
bytes written (exact) and the median seconds over the runs (noisy on a
shared machine). Writes benchmarks/results/checkpoint-ref-cpu.json unless
--out says otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "overlap"))

import models  # noqa: E402  (puts client/python on sys.path through char_gpt)
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import dmuon  # noqa: E402
from dmuon import AdamWOptions, DaemonOptions, RoutingOptions  # noqa: E402
from dmuon.optim import DMuon  # noqa: E402

MODES = ("full", "reference")
# The daemon: marks in memory only, or also written (and fsynced) to a
# --state-dir before Mark returns, which state_dict() waits for.
DAEMONS = ("memory", "state_dir")


def size_of(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f))
               for d, _, files in os.walk(path) for f in files)


def make(address, mode, corpus):
    model = models.build(models.MODELS["gpt-4l-384"], corpus)
    opt = DMuon(model, **models.char_gpt.MUON,
                adamw_options=AdamWOptions(**models.char_gpt.ADAMW),
                routing_options=RoutingOptions(adamw=[model.head]),
                daemon_options=DaemonOptions(address, job_id=f"ckpt-{mode}",
                                             checkpoint_momentum=mode))
    return model, opt


def step(model, opt, batch):
    x, y = batch
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    opt.step()
    opt.zero_grad()


def save_torch(opt, path):
    torch.save(opt.state_dict(), path)


def save_dcp(opt, path):
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)


def timed(save, opt, path):
    """(seconds, bytes written) of save(opt, path)."""
    t0 = time.perf_counter()
    save(opt, path)
    return time.perf_counter() - t0, size_of(path)


def measure(runs, tmp, flags):
    """{mode: {way: {bytes, median_seconds, seconds}}} and the Muon elements,
    against a private dmuond started with `flags`."""
    corpus = models.char_gpt.Corpus()
    batches = models.batches(corpus, 1024, 2 * runs)
    out = {m: {"torch_save": [], "dcp_save": []} for m in MODES}
    sizes = {}
    with dmuon.LocalDaemon(flags=flags, stop_grace=2.0) as d:
        jobs = {m: make(d.address, m, corpus) for m in MODES}
        for r in range(runs):
            for mode, (model, opt) in jobs.items():
                for how, save, ext in (("torch_save", save_torch, "pt"),
                                       ("dcp_save", save_dcp, "dcp")):
                    step(model, opt, batches[2 * r + (how == "dcp_save")])  # a new step: state_dict() marks it
                    t, sizes[(mode, how)] = timed(save, opt,
                                                  os.path.join(tmp, f"{mode}-{r}.{ext}"))
                    out[mode][how].append(t)
        muon = sum(p.numel() for g in jobs["full"][1].param_groups if g["use_muon"]
                   for p in g["params"])
        for _, opt in jobs.values():
            opt.close()
    return {m: {how: {"bytes": sizes[(m, how)], "median_seconds": statistics.median(ts),
                      "seconds": ts} for how, ts in out[m].items()} for m in MODES}, muon


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="checkpoints per mode and way")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "checkpoint-ref-cpu.json"),
                    help="where the JSON goes")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {}
    for daemon in DAEMONS:
        with tempfile.TemporaryDirectory() as tmp:
            flags = [f"--state-dir={tmp}/state"] if daemon == "state_dir" else []
            results[daemon], muon = measure(args.runs, tmp, flags)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or
                       platform.machine(), "torch": torch.__version__,
                       "note": "shared with other builds: timings are noisy; bytes are exact"},
           "command": "benchmarks/checkpoint_ref.py --runs %d" % args.runs,
           "model": "gpt-4l-384", "muon_elements": muon, "results": results}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'dmuond':<10} {'mode':<10} {'way':<11} {'bytes':>11} {'median s':>9}")
    for daemon in DAEMONS:
        for mode in MODES:
            for how, r in results[daemon][mode].items():
                print(f"{daemon:<10} {mode:<10} {how:<11} {r['bytes']:>11} "
                      f"{r['median_seconds']:>9.4f}")


if __name__ == "__main__":
    main()

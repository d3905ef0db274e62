"""./dmuon bench client: per-step time of the demo's char-GPT with AdamW,
in-process Muon and DMuon (through dmuond), with the exposed optimizer time
(step() plus, for DMuon, the gradient hand-off inside backward). Medians over
several runs; writes benchmarks/results/client.json and prints a table.
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch

import char_gpt

LABELS = {"adamw": "AdamW", "muon": "Muon (in-process)", "dmuon": "DMuon (dmuond)"}


def measure(kind, corpus, steps, warmup, device, server, clip=None, overlap=True):
    run = char_gpt.train(kind, corpus, warmup + steps, device=device, server=server,
                         clip=clip, overlap=overlap)
    it, st = run["iter_seconds"][warmup:], run["step_seconds"][warmup:]
    handoff = run.get("handoff_seconds", 0.0) / (warmup + steps)
    return {"iteration_ms": 1000 * statistics.median(it),
            "step_ms": 1000 * statistics.median(st),
            "exposed_ms": 1000 * (statistics.median(st) + handoff),
            "handoff_ms": 1000 * handoff, "redone_steps": run.get("redone_steps", 0)}


# --clip: gradient clipping after backward(), which DMuon (overlap on) sees at
# step() and has dmuond redo (client/python/README.md, "Editing gradients
# after backward()"). (label, kind, clip max_norm, overlap)
CLIP_VARIANTS = (
    ("Muon (in-process), no clip", "muon", None, True),
    ("Muon (in-process), clip", "muon", 1e-3, True),
    ("DMuon, no clip", "dmuon", None, True),
    ("DMuon, clip that never clips", "dmuon", 1e9, True),
    ("DMuon, clip every step", "dmuon", 1e-3, True),
    ("DMuon overlap=False, clip every step", "dmuon", 1e-3, False),
)


def clip_table(args, corpus, device):
    results = {}
    for label, kind, clip, overlap in CLIP_VARIANTS:
        reps = [measure(kind, corpus, args.steps, args.warmup, device, args.server,
                        clip, overlap) for _ in range(args.repeats)]
        results[label] = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        results[label]["runs"] = reps
        r = results[label]
        print(f"  {label:<38} {r['iteration_ms']:7.1f} ms/step  step() {r['step_ms']:6.1f} ms"
              f"  (+clip)  redone {r['redone_steps']:.0f}", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured steps first")
    ap.add_argument("--repeats", type=int, default=3, help="runs per optimizer (medians)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    ap.add_argument("--server", default="auto", help="auto or host:port of a dmuond")
    ap.add_argument("--clip", action="store_true",
                    help="instead: gradient clipping after backward, with and without "
                    "clipping, overlap on and off (writes client-clip.json)")
    ap.add_argument("--out", default=os.path.join(char_gpt.HERE, "..", "..", "..",
                                                  "benchmarks", "results", "client.json"),
                    help="the JSON written (default: benchmarks/results/client.json)")
    args = ap.parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    corpus = char_gpt.Corpus(device=device)
    tokens = corpus.batch(0)[0].numel()
    results = {}
    t0 = time.perf_counter()
    if args.clip:
        out = os.path.join(os.path.dirname(os.path.abspath(args.out)), "client-clip.json")
        res = {"benchmark": "client-clip", "device": device, "torch": torch.__version__,
               "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
               "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
               "statistic": "median over steps, then median over repeats; step_ms "
               "includes clip_grad_norm_",
               "results": clip_table(args, corpus, device),
               "seconds": time.perf_counter() - t0}
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {os.path.relpath(out)}")
        return
    for kind in ("adamw", "muon", "dmuon"):
        reps = [measure(kind, corpus, args.steps, args.warmup, device, args.server)
                for _ in range(args.repeats)]
        results[kind] = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        results[kind]["runs"] = reps
        results[kind]["tokens_per_second"] = tokens / (results[kind]["iteration_ms"] / 1000)
        print(f"  {LABELS[kind]:<18} {results[kind]['iteration_ms']:7.1f} ms/step", flush=True)
    base = results["adamw"]["iteration_ms"]
    rows = [("optimizer", "ms/step", "tokens/s", "step() ms", "exposed opt ms",
             "vs AdamW ms")]
    for kind, r in results.items():
        rows.append((LABELS[kind], f"{r['iteration_ms']:.1f}", f"{r['tokens_per_second']:.0f}",
                     f"{r['step_ms']:.1f}", f"{r['exposed_ms']:.1f}",
                     f"{r['iteration_ms'] - base:+.1f}"))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r))
             for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    print("\n".join(lines))
    model = char_gpt.GPT(corpus.vocab)
    out = {
        "benchmark": "client", "device": device, "torch": torch.__version__,
        "host": platform.node(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
        "model": {"parameters": sum(p.numel() for p in model.parameters()),
                  "matrices": len(model.matrices()), "tokens_per_step": tokens},
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "statistic": "median over steps, then median over repeats",
        "results": results, "seconds": time.perf_counter() - t0,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()

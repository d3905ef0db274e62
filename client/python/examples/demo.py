"""./dmuon demo: a small GPT-style character model trained three ways —
AdamW, in-process Muon, and dmuon.optim.DMuon through a dmuond started for
it — with a table, the DMuon-vs-Muon loss agreement, a loss plot and a JSON.

  ./dmuon demo [--steps 300] [--device auto] [--server auto|host:port]
      [--out out/demo]
  (or .venv/bin/python client/python/examples/demo.py ...: the project's
  Python, which has torch; Debian's /usr/bin/python3 has not)
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

import char_gpt

KINDS = ("adamw", "muon", "dmuon")
LABELS = {"adamw": "AdamW", "muon": "Muon (in-process)", "dmuon": "DMuon (dmuond)"}


def progress_printer():
    tty = sys.stdout.isatty()
    last = {}

    def show(kind, step, steps, loss, elapsed):
        line = (f"  {LABELS[kind]:<18} step {step:>4}/{steps}  loss {loss:6.3f}  "
                f"{step / elapsed:5.1f} steps/s")
        if tty:
            print("\r" + line, end="\n" if step == steps else "", flush=True)
        elif step == steps or step - last.get(kind, 0) >= max(1, steps // 6):
            last[kind] = step
            print(line, flush=True)

    return show


def summarize(kind, run, tokens_per_step, skip):
    it = run["iter_seconds"][skip:]
    st = run["step_seconds"][skip:]
    exposed = statistics.mean(st)
    if kind == "dmuon":  # the hooks' copies in backward are exposed too
        exposed += run["handoff_seconds"] / len(run["iter_seconds"])
    return {
        "final_loss": statistics.mean(run["losses"][-10:]),
        "tokens_per_second": tokens_per_step / statistics.mean(it),
        "iteration_ms": 1000 * statistics.mean(it),
        "optimizer_step_ms": 1000 * statistics.mean(st),
        "exposed_optimizer_ms": 1000 * exposed,
        "total_seconds": run["total_seconds"],
    }


def table(rows):
    head = ("optimizer", "final loss", "tokens/s", "iter ms", "step() ms",
            "exposed opt ms", "total s")
    lines = [head]
    for kind, s in rows.items():
        lines.append((LABELS[kind], f"{s['final_loss']:.4f}",
                      f"{s['tokens_per_second']:.0f}", f"{s['iteration_ms']:.1f}",
                      f"{s['optimizer_step_ms']:.1f}", f"{s['exposed_optimizer_ms']:.1f}",
                      f"{s['total_seconds']:.1f}"))
    w = [max(len(r[i]) for r in lines) for i in range(len(head))]
    out = ["  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r))
           for r in lines]
    out.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(out)


def plot(runs, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    styles = {"adamw": dict(color="tab:gray"), "muon": dict(color="tab:blue", lw=2.5),
              "dmuon": dict(color="tab:orange", ls="--")}
    for kind, run in runs.items():
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=LABELS[kind],
                **styles[kind])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy, nats/char)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps per optimizer")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    ap.add_argument("--server", default="auto", help="auto or host:port of a dmuond")
    # An untracked folder: a run does not rewrite the checked-in results
    # (refresh those with --out benchmarks/results).
    ap.add_argument("--out", default=os.path.join(char_gpt.HERE, "..", "..", "..",
                                                  "out", "demo"),
                    help="where demo.json and demo.png go (default: out/demo)")
    args = ap.parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    corpus = char_gpt.Corpus(device=device)
    model = char_gpt.GPT(corpus.vocab)
    n_params = sum(p.numel() for p in model.parameters())
    n_muon = sum(p.numel() for p in model.matrices())
    x, _ = corpus.batch(0)
    tokens = x.numel()
    print(f"dmuon demo: {n_params / 1e6:.2f}M-parameter GPT ({len(model.blocks)} layers, "
          f"{len(model.matrices())} matrices = {n_muon / 1e6:.2f}M parameters for Muon) on "
          f"{char_gpt.CORPUS} ({len(corpus.data)} chars, vocab {corpus.vocab}); "
          f"{args.steps} steps of {tokens} tokens on {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    runs, show = {}, progress_printer()
    t0 = time.perf_counter()
    for kind in KINDS:
        runs[kind] = char_gpt.train(kind, corpus, args.steps, device=device,
                                    server=args.server, progress=show)
    skip = min(5, args.steps - 1)
    rows = {k: summarize(k, r, tokens, skip) for k, r in runs.items()}
    print()
    print(table(rows))
    rel = [abs(a - b) / abs(b) for a, b in zip(runs["dmuon"]["losses"], runs["muon"]["losses"])]
    first_20 = max(rel[:20])
    print(f"\nDMuon vs in-process Muon: relative loss difference {first_20:.1e} at most over "
          f"the first 20 steps, {max(rel):.1e} at most over all {len(rel)} (final step "
          f"{rel[-1]:.1e}). Both are fp32 with different BLAS libraries: equal to rounding, "
          f"which training slowly amplifies.")
    gap = rows["adamw"]["final_loss"] - rows["muon"]["final_loss"]
    print(f"Muon's final loss is {gap:.3f} nats/char below AdamW's (mean of the last 10 "
          f"steps). DMuon used the {runs['dmuon'].get('transport')} transport.")
    if device == "cpu" and args.server == "auto":
        free = (os.cpu_count() or 1) - torch.get_num_threads()
        if free >= 1:
            print(f"Timing: torch trains on {torch.get_num_threads()} thread(s); the private "
                  f"dmuond computes on the {free} core(s) left free, overlapped with "
                  "backward, so step() only waits for what is not back yet.")
        else:
            print("Timing: torch uses every core, so the private dmuond's work overlapped "
                  "with backward competes with it for the same cores; the overlap pays "
                  "off when dmuond has cores or GPUs of its own.")
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "demo.png")
    js = os.path.join(args.out, "demo.json")
    plot(runs, png, f"char-GPT on GPL-3, {args.steps} steps, {device}")
    with open(js, "w") as f:
        json.dump({
            "model": {"parameters": n_params, "muon_parameters": n_muon,
                      "layers": len(model.blocks), "tokens_per_step": tokens},
            "steps": args.steps, "device": device, "torch": torch.__version__,
            "host": platform.node(), "cpu_threads": torch.get_num_threads(),
            "summary": rows,
            "dmuon_vs_muon_relative_loss_difference": {
                "max": max(rel), "max_first_20_steps": first_20, "final": rel[-1]},
            "losses": {k: r["losses"] for k, r in runs.items()},
        }, f, indent=1)
    print(f"wrote {os.path.relpath(png)} and {os.path.relpath(js)} "
          f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

"""The report of `./dmuon bench overlap`: a markdown table per point (the
terminal and benchmarks/README.md) and the plot (iteration vs tokens per
step, one line per optimizer, the bound drawn; one panel per model).

  python report.py RESULTS.json [PLOT.png]   # the tables again; the plot if named
"""

from __future__ import annotations

import json
import sys

from optimizers import LABELS


def _spread(rounds: list[float] | None) -> str:
    """With rounds: the rounds' lowest and highest, after the median."""
    return f" [{min(rounds):.2f}-{max(rounds):.2f}]" if rounds else ""


def _row(label: str, r: dict) -> str:
    loss = r.get("loss_rel_diff_vs_muon_fp32")
    in_run = (f"{r['vs_bound_in_run']:.2f} ({r['bound_in_run_ms']:.0f} ms)"
              if "vs_bound_in_run" in r else "-")
    return (f"| {label} | {r['iteration_ms']:.0f} ms | "
            + (f"{r['vs_adamw']:.2f}" if "vs_adamw" in r else "-")
            + f" | {r['vs_bound']:.2f}{_spread(r.get('vs_bound_rounds'))} | {in_run} | "
            + (f"{loss:.1e}" if loss is not None else "-") + " |")


def point_table(p: dict) -> str:
    """One point: each optimizer's median iteration, against AdamW, the
    bound and (DMuon) the bound with its run's own Newton-Schulz times, and
    its final loss against fp32-NS torch Muon's."""
    rounds = f" (medians of {len(p['rounds'])} rounds)" if "rounds" in p else ""
    lines = [f"{p['model']}, {p['tokens']} tokens per step{rounds}: forward+backward "
             f"{p['forward_backward_ms']:.0f} ms, Newton-Schulz {p['ns_ms']:.0f} ms "
             f"({p['ns_over_fb']:.2f}x), bound {p['bound_ms']:.0f} ms", "",
             "| optimizer | iteration | vs AdamW | vs bound | vs bound with the run's "
             "NS | final loss vs fp32 Muon |",
             "|---|---|---|---|---|---|"]
    lines += [_row(LABELS[k], r) for k, r in p["results"].items()]
    lines += [f"| {LABELS[k]} | skipped (below) | - | - | - | - |"
              for k in p.get("skipped", {})]
    pair = p.get("pair")
    if pair:
        b = max(pair["bound_ms"])
        for kind, runs in pair["results"].items():
            its = " / ".join(f"{r['iteration_ms']:.0f}" for r in runs)
            # With rounds, the median of the rounds' own (rounds.py).
            worst = pair.get("vs_bound", {}).get(kind) or \
                max(r["iteration_ms"] for r in runs) / b
            spread = _spread(pair.get("vs_bound_rounds", {}).get(kind))
            lines.append(f"| 2 trainers, {LABELS[kind]} | {its} ms | - | {worst:.2f}"
                         f"{spread} (pair bound {b:.0f} ms) | - | - |")
    lines += ["", *(f"{LABELS[k]}: skipped: {why}." for k, why in p.get("skipped", {}).items())]
    return "\n".join(lines).rstrip()


def tables(res: dict) -> str:
    return "\n\n".join(point_table(p) for p in res["points"])


def summary_table(res: dict) -> str:
    """Every point in one table: NS / (forward + backward), each
    optimizer's median iteration (ms), the bound, the largest final-loss
    difference of a DMuon variant from fp32 torch Muon."""
    kinds = list(res["optimizers"])
    lines = ["| model | tokens | NS / fwd+bwd | " + " | ".join(kinds)
             + " | bound | DMuon loss vs fp32 Muon |",
             "|---|---|---|" + "---|" * len(kinds) + "---|---|"]
    for p in res["points"]:
        r = p["results"]
        its = [f"{r[k]['iteration_ms']:.0f}" if k in r else "-" for k in kinds]
        diffs = [x["loss_rel_diff_vs_muon_fp32"] for k, x in r.items()
                 if k.startswith("dmuon") and "loss_rel_diff_vs_muon_fp32" in x]
        lines.append(f"| {p['model']} | {p['tokens']} | {p['ns_over_fb']:.2f} | "
                     + " | ".join(its) + f" | {p['bound_ms']:.0f} | "
                     + (f"{max(diffs):.1e}" if diffs else "-") + " |")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    """Iteration (ms) vs tokens per step, a panel per model, a line per
    optimizer, the bound dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(p["model"] for p in res["points"]))
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        pts = sorted((p for p in res["points"] if p["model"] == model),
                     key=lambda p: p["tokens"])
        x = [p["tokens"] for p in pts]
        for kind in res["optimizers"]:
            y = [p["results"][kind]["iteration_ms"] if kind in p["results"] else None
                 for p in pts]
            ax.plot(x, y, marker="o", label=LABELS[kind])
        ax.plot(x, [p["bound_ms"] for p in pts], "k--", marker="x", label="bound")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(t) for t in x])
        ax.set_xlabel("tokens per step")
        ax.set_ylabel("iteration (ms, median)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    m = res["machine"]
    fig.suptitle(f"trainer on cores {res['trainer_cpus']}, dmuond on cores "
                 f"{res['daemon_cpus']}: {m['cpu']}, {res['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    with open(argv[0]) as f:
        res = json.load(f)
    print(tables(res))
    print()
    print(summary_table(res))
    if len(argv) > 1:
        plot(res, argv[1])


if __name__ == "__main__":
    main(sys.argv[1:])

"""Chart of benchmarks/results/scaling.json: predicted optimizer step and
exposed optimizer time vs GPU count, one panel per model, log-log.

usage: /usr/bin/python3 plot.py scaling.json scaling.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {
    "redundant": ("in-trainer Muon, every rank", "tab:red"),
    "round_robin": ("round-robin ownership", "tab:orange"),
    "dmuon": ("dmuon pool (shared GPUs)", "tab:blue"),
    "dmuon_dedicated": ("dmuon pool (dedicated devices)", "tab:cyan"),
    "adamw": ("fused AdamW, every rank", "tab:green"),
}


def main(src, dst):
    with open(src) as f:
        data = json.load(f)
    models = [m["model"] for m in data["models"]]
    cols = 3
    rows = (len(models) + 1 + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.0 * rows))
    axes = axes.flatten()
    for ax, model in zip(axes, models):
        for strategy, (label, color) in STYLE.items():
            pts = sorted(
                (r["gpus"], r["optimizer_s"], r["exposed_s"])
                for r in data["rows"]
                if r["model"] == model and r["strategy"] == strategy
            )
            if not pts:
                continue
            g = [p[0] for p in pts]
            ax.plot(g, [p[2] * 1e3 for p in pts], "o-", color=color, label=label,
                    ms=3)
            if strategy == "dmuon":  # dedicated: both equal
                ax.plot(g, [p[1] * 1e3 for p in pts], "--", color=color, lw=1,
                        label="dmuon (shared), no forward overlap")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(model)
        ax.set_xlabel("GPUs (8 per node)")
        ax.set_ylabel("optimizer time per step, ms")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    legend_ax = axes[len(models)]
    legend_ax.axis("off")
    legend_ax.legend(handles, labels, loc="upper left", fontsize=8, frameon=False)
    a = data["assumptions"]
    legend_ax.text(
        0.0, 0.02,
        "solid: exposed (added to the step); dashed: dmuon's optimizer step\n"
        "with no forward overlap (the others: both equal)\n"
        f"H200 cost model: {a['peak_tflops']:.0f} TFLOP/s x {a['efficiency']}, "
        f"HBM {a['hbm_tbps']} TB/s\n"
        f"NVLink {a['nvlink_gbps']:.0f} GB/s, IB {a['ib_gbps']:.0f} GB/s per GPU; "
        f"{a['tokens_per_gpu']:.0f} tokens/GPU at MFU {a['mfu']}\n"
        "no GPU measurements yet: kernel times are predicted\n"
        f"{data['date']}",
        fontsize=7.5, va="bottom", transform=legend_ax.transAxes)
    for ax in axes[len(models) + 1:]:
        ax.axis("off")
    fig.suptitle("Predicted optimizer time vs GPU count (simulator, "
                 "benchmarks/scaling)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])

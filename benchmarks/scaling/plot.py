"""Chart of benchmarks/results/scaling.json: predicted optimizer step and
exposed optimizer time vs GPU count, one panel per model and job
(replicated, FSDP2), log-log.

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


JOB_TITLE = {
    "replicated": "replicated (DDP) job",
    "fsdp2": "FSDP2 job: each rank applies and AdamW-updates its 1/G shard",
}


def main(src, dst):
    with open(src) as f:
        data = json.load(f)
    models = [m["model"] for m in data["models"]]
    jobs = []
    for r in data["rows"]:
        job = r.get("job", "replicated")
        if job not in jobs:
            jobs.append(job)
    cols = 3
    per_job = (len(models) + 1 + cols - 1) // cols  # panel rows per job
    fig, axes = plt.subplots(per_job * len(jobs), cols,
                             figsize=(5.2 * cols, 4.0 * per_job * len(jobs)))
    axes = axes.flatten()
    a = data["assumptions"]
    for j, job in enumerate(jobs):
        job_axes = axes[j * per_job * cols:(j + 1) * per_job * cols]
        for ax, model in zip(job_axes, models):
            for strategy, (label, color) in STYLE.items():
                if job == "fsdp2" and strategy == "adamw":
                    label = "fused AdamW, sharded (1/G per rank)"
                pts = sorted(
                    (r["gpus"], r["optimizer_s"], r["exposed_s"])
                    for r in data["rows"]
                    if r["model"] == model and r["strategy"] == strategy
                    and r.get("job", "replicated") == job
                )
                if not pts:
                    continue
                g = [p[0] for p in pts]
                ax.plot(g, [p[2] * 1e3 for p in pts], "o-", color=color,
                        label=label, ms=3)
                if strategy == "dmuon":  # dedicated: both equal
                    ax.plot(g, [p[1] * 1e3 for p in pts], "--", color=color,
                            lw=1, label="dmuon (shared), no forward overlap")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{model} — {job}")
            ax.set_xlabel("GPUs (8 per node)")
            ax.set_ylabel("optimizer time per step, ms")
            ax.grid(True, which="both", alpha=0.3)
        handles, labels = job_axes[0].get_legend_handles_labels()
        legend_ax = job_axes[len(models)]
        legend_ax.axis("off")
        legend_ax.set_title(JOB_TITLE.get(job, job), fontsize=9)
        legend_ax.legend(handles, labels, loc="upper left", fontsize=8,
                         frameon=False)
        legend_ax.text(
            0.0, 0.02,
            "solid: exposed (added to the step); dashed: dmuon's optimizer\n"
            "step with no forward overlap (the others: both equal)\n"
            f"H200 cost model: {a['peak_tflops']:.0f} TFLOP/s x "
            f"{a['efficiency']}, HBM {a['hbm_tbps']} TB/s\n"
            f"NVLink {a['nvlink_gbps']:.0f} GB/s, IB {a['ib_gbps']:.0f} GB/s "
            f"per GPU; {a['tokens_per_gpu']:.0f} tokens/GPU at MFU {a['mfu']}\n"
            "a simulation: no GPU measurement, kernel times are predicted\n"
            f"{data['date']}",
            fontsize=7.5, va="bottom", transform=legend_ax.transAxes)
        for ax in job_axes[len(models) + 1:]:
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

"""The GPU check's targets, judged from the JSON files the run left in $OUT:
one line per target with the measured figure and PASS, FAIL or "not
measured" (the step did not run, failed before measuring, or ran without a
GPU), then the informational lines. run.sh appends them to summary.txt; they
never change the run's exit status, which says whether the check ran.

Targets, on one H200 (benchmarks/README.md, "Targets"):
  - direct NS (bf16) rate / the same-shape GEMM rate (kernels-gpu.json,
    rows "direct-bf16" and "gemm-bf16": gflops / peak_gflops):
    >= 0.75 at 4096x4096, >= 0.9 at 4096x14336;
  - seconds(direct bf16) / seconds(Gram fp16) at 4096x14336, batch 1
    (rows "direct-bf16", "gram-fp16") and batch 8 ("direct-batched",
    "gram-batched"): >= 1.4;
  - the Llama-3-8B optimizer step through dmuond_cuda, method auto
    (llama3-8b-step.json, passes["cuda_ipc/auto"]): median <= 1.3x the
    physical floor, computed here from the run's own measurements:
    executed_tflop / gemm_tflops + moved_gb / copy_gb_per_s (the GEMM flops
    the NS plans execute at the measured bf16 GEMM rate, plus the bytes the
    memory-bound passes move at the measured device copy rate;
    benchmarks/gpu/step_floor.h);
  - the same step vs torch.optim.Muon's step() on the same GPU
    (torch-llama.json, optimizers.muon.median_seconds): >= 1.5x faster.
Informational: fused AdamW's step on the same parameters, and DMuon's
exposed step() next to fused AdamW's in torch_train (torch-train.json).

  python3 targets.py OUT_DIR
"""

import json
import os
import sys

WIDTH = 62


def load(out, name):
    """The JSON file `name` under `out`, or None when absent or unreadable."""
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def line(what, measured, target, verdict):
    return f"TARGET {what:<{WIDTH}} {measured:>14} {target:>9}  {verdict}"


def judge(what, value, target, at_least, fmt="{:.3f}"):
    """A target line: `value` against `target` (>= when at_least, else <=);
    `value` None or a str (why) means not measured."""
    bound = (">= " if at_least else "<= ") + f"{target:g}"
    if value is None or isinstance(value, str):
        why = f" ({value})" if isinstance(value, str) else ""
        return line(what, "-", bound, "not measured" + why)
    ok = value >= target if at_least else value <= target
    return line(what, fmt.format(value), bound, "PASS" if ok else "FAIL")


def row(kernels, shape, method, batch):
    """The kernels-gpu.json row, or a str saying why there is none."""
    if kernels is None:
        return "no kernels-gpu.json"
    for r in kernels.get("rows", []):
        if r.get("shape") == shape and r.get("method") == method and r.get("batch") == batch:
            return r
    return f"no {method} row at {shape}, batch {batch}"


def positive(*values):
    return all(isinstance(v, (int, float)) and v > 0 for v in values)


def ns_vs_gemm(kernels, shape):
    r = row(kernels, shape, "direct-bf16", 1)
    if isinstance(r, str):
        return r
    if not positive(r.get("gflops"), r.get("peak_gflops")):
        return "no rates in the row"
    return r["gflops"] / r["peak_gflops"]


def direct_over_gram(kernels, shape, batch):
    d = row(kernels, shape, "direct-bf16" if batch == 1 else "direct-batched", batch)
    g = row(kernels, shape, "gram-fp16" if batch == 1 else "gram-batched", batch)
    for r in (d, g):
        if isinstance(r, str):
            return r
    if not positive(d.get("seconds"), g.get("seconds")):
        return "no times in the rows"
    return d["seconds"] / g["seconds"]


def llama_pass(step):
    """passes["cuda_ipc/auto"] with its median, or a str saying why not."""
    if step is None:
        return "no llama3-8b-step.json"
    if "skipped" in step:
        return f"skipped: {step['skipped']}"
    p = step.get("passes", {}).get("cuda_ipc/auto")
    if p is None:
        return step.get("error", "no cuda_ipc/auto pass")
    if "error" in p:
        return "the pass failed"
    if not positive(p.get("median_seconds")):
        return "no timed step"
    return p


def floor_seconds(step):
    """The physical floor from the run's own figures, or a str (why not)."""
    p = llama_pass(step)
    if isinstance(p, str):
        return p
    need = (p.get("executed_tflop"), step.get("gemm_tflops"), p.get("moved_gb"),
            step.get("copy_gb_per_s"))
    if not positive(*need):
        return "no floor ingredients (executed_tflop, gemm_tflops, moved_gb, copy_gb_per_s)"
    tflop, tflops, gb, gbs = need
    return tflop / tflops + gb / gbs


def torch_median(torch_llama, optimizer):
    """(median seconds, where) of torch_step.py's `optimizer`, or a str."""
    if torch_llama is None:
        return "no torch-llama.json"
    e = torch_llama.get("optimizers", {}).get(optimizer)
    if e is None or "error" in e or not positive(e.get("median_seconds")):
        return f"no {optimizer} median"
    where = torch_llama.get("device", "?")
    if torch_llama.get("shrink", 1) != 1:
        where += f", shapes / {torch_llama['shrink']}"
    return e["median_seconds"], where


def lines(out):
    kernels = load(out, "kernels-gpu.json")
    step = load(out, "llama3-8b-step.json")
    torch_llama = load(out, "torch-llama.json")
    train = load(out, "torch-train.json")
    res = [
        judge("direct NS bf16 4096x4096: NS rate / same-shape GEMM rate",
              ns_vs_gemm(kernels, "4096x4096"), 0.75, True),
        judge("direct NS bf16 4096x14336: NS rate / same-shape GEMM rate",
              ns_vs_gemm(kernels, "4096x14336"), 0.9, True),
        judge("4096x14336 batch 1: seconds(direct bf16) / seconds(Gram fp16)",
              direct_over_gram(kernels, "4096x14336", 1), 1.4, True),
        judge("4096x14336 batch 8: seconds(direct bf16) / seconds(Gram fp16)",
              direct_over_gram(kernels, "4096x14336", 8), 1.4, True),
    ]
    p, floor = llama_pass(step), floor_seconds(step)
    vs_floor = floor if isinstance(floor, str) else p["median_seconds"] / floor
    what = "Llama-3-8B step (auto) / physical floor"
    if not isinstance(floor, str):
        what += f" {floor:.3f} s"
    res.append(judge(what, vs_floor, 1.3, False, "{:.2f}x"))
    muon = torch_median(torch_llama, "muon")
    if isinstance(p, str):
        speedup = p
    elif isinstance(muon, str):
        speedup = muon
    elif muon[1] != "cuda":
        speedup = f"torch.optim.Muon ran on {muon[1]}"
    else:
        speedup = muon[0] / p["median_seconds"]
    res.append(judge("Llama-3-8B: torch.optim.Muon step() / DMuon step (auto)",
                     speedup, 1.5, True, "{:.2f}x"))
    adamw = torch_median(torch_llama, "adamw_fused")
    a = f"{adamw[0]:.4f} s ({adamw[1]})" if not isinstance(adamw, str) else f"not measured ({adamw})"
    t = (train or {}).get("timing", {})
    if positive(t.get("dmuon", {}).get("step_ms"), t.get("adamw_fused", {}).get("step_ms")):
        tr = (f"DMuon exposed step() {t['dmuon']['step_ms']:.2f} ms, fused AdamW "
              f"{t['adamw_fused']['step_ms']:.2f} ms ({train.get('device', '?')})")
    else:
        tr = "not measured"
    res.append(f"INFO   fused AdamW step, Llama-3-8B: {a}; torch_train: {tr}")
    return res


def main(argv):
    if len(argv) != 2 or not os.path.isdir(argv[1]):
        print("usage: targets.py OUT_DIR (the GPU check's $OUT)", file=sys.stderr)
        return 64
    print("\n".join(lines(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""The GPU check's in-trainer baselines for the Llama-3-8B optimizer step:
torch.optim.Muon (torch's own: bf16 Newton-Schulz with dense products, one
matrix after another) or torch.optim.AdamW(fused=True), stepping fp32
parameters of the shapes gpu_step runs through dmuond_cuda (the table's
224 Muon matrices), with random gradients, timed between CUDA
synchronizations.

One optimizer per process (--optimizer): Muon holds parameters, gradients
and momentum (3 x 28 GB), fused AdamW parameters, gradients and two moments
(4 x 28 GB); neither fits beside dmuond_cuda's state, nor both together, in
the H200's 139 GiB, so run.sh runs them one after another, after gpu_step.

--out holds one entry per optimizer under "optimizers"; this process
replaces its own, rewriting the file after every step (and with "error" if
it fails), so a crash or a timeout keeps what was measured.

  python3 torch_step.py --optimizer muon --table data/llama3-8b.json \
      --out OUT/torch-llama.json [--steps 5] [--warmup 1] [--device cuda]
  --shrink K divides every dimension by K (a CPU rehearsal: --device cpu).
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

MUON = dict(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)  # char_gpt's
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def save(result, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def dense_ns_flops(shapes, steps=5):
    """Direct NS with dense products, as torch.optim.Muon runs it:
    steps * (4 m^2 n + 2 m^3), m the smaller dimension."""
    total = 0
    for r, c in shapes:
        m, n = min(r, c), max(r, c)
        total += steps * (4 * m * m * n + 2 * m ** 3)
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", required=True, choices=("muon", "adamw_fused"))
    ap.add_argument("--table", required=True, help="JSON with muon_matrices[].shape")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (odd: a real median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shrink", type=int, default=1)
    args = ap.parse_args()
    with open(args.table) as f:
        table = json.load(f)
    shapes = [(m["shape"][0] // args.shrink, m["shape"][1] // args.shrink)
              for m in table["muon_matrices"]]
    cuda = args.device.startswith("cuda")
    result = load(args.out)
    result.update(table=os.path.basename(args.table), matrices=len(shapes),
                  parameters=sum(r * c for r, c in shapes), shrink=args.shrink,
                  torch=torch.__version__, device=args.device,
                  gpu=torch.cuda.get_device_name(0) if cuda else None,
                  dense_direct_ns_tflop=dense_ns_flops(shapes) / 1e12)
    entry = result.setdefault("optimizers", {})[args.optimizer] = dict(done=False)
    save(result, args.out)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(r, c, device=args.device)) for r, c in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        if args.optimizer == "muon":
            opt = torch.optim.Muon(params, **MUON)
        else:
            opt = torch.optim.AdamW(params, fused=True, **ADAMW)
        warm, times = [], []
        for s in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            dt = time.perf_counter() - t0
            (times if s >= args.warmup else warm).append(dt)
            print(f"{args.optimizer} step {s + 1}{'' if s >= args.warmup else ' (warm-up)'}: "
                  f"{dt:.4f} s", flush=True)
            entry.update(warmup_seconds=warm, step_seconds=times)
            if times:
                entry["median_seconds"] = statistics.median(times)
            if cuda:
                entry["max_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
            save(result, args.out)
    except Exception:
        entry.update(error=traceback.format_exc(), done=True)
        save(result, args.out)
        raise
    med = entry["median_seconds"]
    if args.optimizer == "muon":
        entry["dense_ns_tflops"] = result["dense_direct_ns_tflop"] / med
        rate = f"{entry['dense_ns_tflops']:.3g} TFLOP/s of dense bf16 NS"
    else:  # fp32 p, m, v read and written, g read: 28 bytes a parameter
        entry["gb_per_second"] = 28 * result["parameters"] / med / 1e9
        rate = f"{entry['gb_per_second']:.3g} GB/s at 28 bytes a parameter"
    entry["done"] = True
    save(result, args.out)
    print(f"{args.optimizer} on {len(shapes)} matrices ({result['parameters'] / 1e9:.2f}e9 "
          f"parameters, {args.device}, torch {torch.__version__}): median of {len(times)} "
          f"steps {med:.4f} s ({rate})")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Compares dmuon's CUDA Newton-Schulz (through ns_tool) with torch's own.

torch.optim.Muon orthogonalizes with torch.optim._muon._zeropower_via_newtonschulz
(bf16, classic coefficients). Both run on the same random inputs; each is
also compared with the exact polar-factor oracle U f(S) V^T in fp64, so the
table says how far each is from the exact answer, not only from the other.
--out is rewritten after every row. --device cpu (a rehearsal on a machine
without a GPU): torch's side and the oracle run on the CPU, and ns_tool's
"no CUDA device" failure is recorded as a skipped row, not a failure.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

CLASSIC = (3.4445, -4.7750, 2.0315)


def torch_ns(g, steps):
    try:
        from torch.optim._muon import _zeropower_via_newtonschulz as f
        return f(g, CLASSIC, steps, 1e-7).float(), "torch.optim._muon"
    except Exception:  # older torch: the same algorithm, written out
        a, b, c = CLASSIC
        x = g.bfloat16()
        t = g.size(0) > g.size(1)
        if t:
            x = x.T
        x = x / x.norm().clamp(min=1e-7)
        for _ in range(steps):
            A = x @ x.T
            x = a * x + (b * A + c * A @ A) @ x
        return (x.T if t else x).float(), "inline copy"


def oracle(g, steps):
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    x = s / max(torch.linalg.norm(s).item(), 1e-7)
    a, b, c = CLASSIC
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return (u * x) @ vh


def rel(a, b):
    return (torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double())).item()


def save(result, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tool", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="1024x1024,1024x4096,4096x1024,4096x4096,127x1000")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    rows, ok = [], True
    result = {"torch": torch.__version__, "device": args.device, "rows": rows, "done": False}
    save(result, args.out)
    torch.manual_seed(0)
    for spec in args.shapes.split(","):
        r, c = map(int, spec.split("x"))
        g = torch.randn(r, c, device=args.device)
        ref, source = torch_ns(g, 5)
        exact = oracle(g, 5).to(args.device)
        for method, dtype in (("direct", "bf16"), ("gram", "fp16")):
            with tempfile.TemporaryDirectory() as d:
                fin, fout = os.path.join(d, "in.bin"), os.path.join(d, "out.bin")
                g.cpu().numpy().astype("<f4").tofile(fin)
                cmd = [args.tool, f"--rows={r}", f"--cols={c}", "--batch=1",
                       f"--method={method}", f"--dtype={dtype}", "--steps=5",
                       "--schedule=classic", f"--in={fin}", f"--out={fout}"]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    why = res.stderr.strip()
                    skip = args.device == "cpu" and "no CUDA device" in why
                    print(f"{spec} {method}: ns_tool {'skipped' if skip else 'failed'}: {why}")
                    rows.append({"shape": spec, "method": method, "dtype": dtype,
                                 "torch_vs_exact": rel(ref, exact), "torch_source": source,
                                 ("skipped" if skip else "error"): why, "pass": skip})
                    ok &= skip
                    save(result, args.out)
                    continue
                ours = torch.from_numpy(np.fromfile(fout, dtype="<f4").reshape(r, c)).to(
                    args.device)
            row = {"shape": spec, "method": method, "dtype": dtype,
                   "vs_torch": rel(ours, ref), "ours_vs_exact": rel(ours, exact),
                   "torch_vs_exact": rel(ref, exact), "finite": bool(torch.isfinite(ours).all()),
                   "torch_source": source}
            # The bound is 2e-2 from the exact oracle; torch's own bf16
            # path is held to nothing, so ours passes at 2e-2 or at no worse
            # than 1.5x torch's own distance from the exact answer.
            bound = max(2e-2, 1.5 * row["torch_vs_exact"])
            row["pass"] = row["finite"] and row["ours_vs_exact"] <= bound
            ok &= row["pass"]
            rows.append(row)
            save(result, args.out)
    print(f"{'shape':<11} {'method':<7} {'vs torch':>9} {'ours/exact':>11} {'torch/exact':>12} pass")
    for r in rows:
        if "vs_torch" not in r:
            print(f"{r['shape']:<11} {r['method']:<7} {'-':>9} {'-':>11} "
                  f"{r['torch_vs_exact']:12.2e} {r['pass']} ({r.get('skipped', 'error')})")
            continue
        print(f"{r['shape']:<11} {r['method']:<7} {r['vs_torch']:9.2e} {r['ours_vs_exact']:11.2e} "
              f"{r['torch_vs_exact']:12.2e} {r['pass']}")
    result.update(ok=ok, done=True)
    save(result, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

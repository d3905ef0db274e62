#!/usr/bin/env python3
"""Compares dmuon's CUDA Newton-Schulz (through ns_tool) with torch's own.

torch.optim.Muon orthogonalizes with torch.optim._muon._zeropower_via_newtonschulz
(bf16, classic coefficients). Both run on the same random inputs; each is
also compared with the exact polar-factor oracle U f(S) V^T in fp64, so the
table says how far each is from the exact answer, not only from the other.
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tool", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="1024x1024,1024x4096,4096x1024,4096x4096,127x1000")
    args = p.parse_args()
    rows, ok = [], True
    torch.manual_seed(0)
    for spec in args.shapes.split(","):
        r, c = map(int, spec.split("x"))
        g = torch.randn(r, c, device="cuda")
        ref, source = torch_ns(g, 5)
        exact = oracle(g, 5).cuda()
        for method, dtype in (("direct", "bf16"), ("gram", "fp16")):
            with tempfile.TemporaryDirectory() as d:
                fin, fout = os.path.join(d, "in.bin"), os.path.join(d, "out.bin")
                g.cpu().numpy().astype("<f4").tofile(fin)
                cmd = [args.tool, f"--rows={r}", f"--cols={c}", "--batch=1",
                       f"--method={method}", f"--dtype={dtype}", "--steps=5",
                       "--schedule=classic", f"--in={fin}", f"--out={fout}"]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    print(f"{spec} {method}: ns_tool failed: {res.stderr.strip()}")
                    ok = False
                    continue
                ours = torch.from_numpy(np.fromfile(fout, dtype="<f4").reshape(r, c)).cuda()
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
    print(f"{'shape':<11} {'method':<7} {'vs torch':>9} {'ours/exact':>11} {'torch/exact':>12} pass")
    for r in rows:
        print(f"{r['shape']:<11} {r['method']:<7} {r['vs_torch']:9.2e} {r['ours_vs_exact']:11.2e} "
              f"{r['torch_vs_exact']:12.2e} {r['pass']}")
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

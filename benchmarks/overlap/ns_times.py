"""The daemon's side of the critical-path bound: Newton-Schulz time per
matrix shape with dmuond's own CPU kernels (the extension's orthogonalize:
kernels::Orthogonalize, the method the cost model picks, as dmuond's "auto"
does), in a process pinned to one of the daemon's cores with one OpenBLAS
thread, as each of dmuond's --cpu-executors runs (the bench gives the
daemon one executor and one OpenBLAS thread per core).

  python ns_times.py --cpus 1 --shapes '[[1152, 384], [384, 384]]' --out ns.json

Writes {"seconds": {"1152x384": s, ...}, ...}: the median of --repeats calls
on a fresh random fp32 matrix each, after one unmeasured call. The momentum
and Nesterov blend dmuond also does per matrix (two passes over it) are left
out: under 1 % of the Newton-Schulz time at these sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# torch.optim.Muon's defaults, which DMuon sends (char_gpt.MUON keeps them).
NS = dict(steps=5, coefficients=(3.4445, -4.775, 2.0315), method="auto", eps=1e-7)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", required=True, help="the daemon's cores, e.g. 1")
    ap.add_argument("--shapes", required=True, help="JSON list of [rows, cols]")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    sys.path.insert(0, HERE)
    from trainer import parse_cpus, pin

    cpus = parse_cpus(args.cpus, "--daemon-cpus")
    pin(cpus[:1])  # one executor's core, one OpenBLAS thread (before it loads)
    import numpy as np
    from models import ROOT  # noqa: F401 (puts the dmuon package on the path)

    from dmuon import _dmuon

    rng = np.random.default_rng(0)
    seconds = {}
    for rows, cols in json.loads(args.shapes):
        times = []
        for r in range(args.repeats + 1):
            g = rng.standard_normal((rows, cols), dtype=np.float32)
            t0 = time.perf_counter()
            _dmuon.orthogonalize(g, **NS)
            if r:
                times.append(time.perf_counter() - t0)
        seconds[f"{rows}x{cols}"] = statistics.median(times)
    with open(args.out, "w") as f:
        json.dump({"seconds": seconds, "cpus": cpus[:1], "options": NS}, f)


if __name__ == "__main__":
    main()

"""The daemon's side of the critical-path bound: Newton-Schulz time per
matrix shape with dmuond's own CPU kernels (the extension's orthogonalize:
kernels::Orthogonalize, with the method the bench's DMuon asks dmuond for:
DMUON_METHOD below), in a process pinned to one of the daemon's cores with one OpenBLAS
thread, as each of dmuond's --cpu-executors runs (the bench gives the
daemon one executor and one OpenBLAS thread per core).

  python ns_times.py --cpus 1 --shapes '[[1152, 384], [384, 384]]' --out ns.json

Writes {"seconds": {"1152x384": s, ...}, ...}: the median of --repeats calls
on a fresh random fp32 matrix each, after one unmeasured call. Beside it,
"torch_fp32_seconds": torch's own Newton-Schulz in fp32 (the client tests'
oracle, what the muon-fp32 optimizer runs) on the same matrices, alternating
with dmuond's call by call on the same core with one thread: how the
daemon's kernels compare with the trainer's library on this CPU. And
"torch_bf16_probe": torch.optim.Muon's own bf16 Newton-Schulz of the
smallest shape, timed once after one unmeasured call, against the fp32 one:
on a CPU without native bf16 matrix products (AMD Zen 3, for one) torch
emulates them and a step of the shipped optimizer takes 30-60x longer than
in fp32 (25 s instead of 0.8 s at gpt-4l-384), which the sweep then skips
(point.py). The momentum
step and Nesterov blend dmuond also does per matrix (one pass over it) are
left out, as is every other hand-off cost: about 2.5 % of the Newton-Schulz
time at these sizes (benchmarks/README.md, "Element passes"; 5 % before it
was vectorized and the step-start copy of the momentum dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# The Newton-Schulz method the bench's DMuon asks dmuond for
# (optimizers.py), and so the one timed here for the bound: "auto" (per
# shape, the cheaper of direct and Gram NS by the cost model). DMuon's own
# default is "direct"; the final loss against fp32 torch Muon's is checked
# either way.
DMUON_METHOD = "auto"
# torch.optim.Muon's defaults, which DMuon sends (char_gpt.MUON keeps them).
NS = dict(steps=5, coefficients=(3.4445, -4.775, 2.0315), method=DMUON_METHOD, eps=1e-7)


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
    use_dmuonds_kernels()  # may start again, pinned: before OpenBLAS is used
    import numpy as np
    import torch
    from models import ROOT  # puts the dmuon package on the path

    from dmuon import _dmuon

    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(ROOT, "client", "python", "tests"))
    from torch_ref import fp32_newton_schulz

    rng = np.random.default_rng(0)
    seconds, torch_seconds = {}, {}
    for rows, cols in json.loads(args.shapes):
        ours, theirs = [], []
        for r in range(args.repeats + 1):
            g = rng.standard_normal((rows, cols), dtype=np.float32)
            t0 = time.perf_counter()
            _dmuon.orthogonalize(g, **NS)
            t1 = time.perf_counter()
            fp32_newton_schulz(torch.from_numpy(g), NS["coefficients"], NS["steps"], NS["eps"])
            if r:
                ours.append(t1 - t0)
                theirs.append(time.perf_counter() - t1)
        seconds[shape_key((rows, cols))] = statistics.median(ours)
        torch_seconds[shape_key((rows, cols))] = statistics.median(theirs)
    probe = bf16_probe(min(json.loads(args.shapes), key=lambda s: s[0] * s[1]),
                       torch_seconds, rng)
    with open(args.out, "w") as f:
        json.dump({"seconds": seconds, "torch_fp32_seconds": torch_seconds,
                   "torch_bf16_probe": probe, "cpus": cpus[:1], "options": NS,
                   "openblas_core": openblas_core()}, f)


def shape_key(shape) -> str:
    """A matrix shape's key in this module's {"RxC": seconds} tables, as
    dmuond's timeline writes it (its "ns" spans' args.shape)."""
    return "x".join(map(str, shape))


def bf16_probe(shape: list[int], torch_seconds: dict, rng) -> dict | None:
    """torch.optim.Muon's bf16 Newton-Schulz of one `shape` matrix on this
    core (one unmeasured call, then one timed) against the fp32 median of
    the same shape; None where torch has no such function (its private name
    moved)."""
    import numpy as np
    import torch
    from torch.optim import _muon

    ns = getattr(_muon, "_zeropower_via_newtonschulz", None)
    if ns is None:
        return None
    key = shape_key(shape)
    times = []
    for _ in range(2):
        g = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
        t0 = time.perf_counter()
        ns(g, NS["coefficients"], NS["steps"], NS["eps"])
        times.append(time.perf_counter() - t0)
    return {"shape": key, "seconds": times[1], "fp32_seconds": torch_seconds[key],
            "ratio": times[1] / torch_seconds[key]}


def from_trace(doc: dict, after_step: int = 0) -> dict[str, float]:
    """{"RxC": seconds}: the median Newton-Schulz time per matrix shape as
    dmuond ran it, from its timeline (--trace-file; `doc` as dmuon.trace.load
    reads it), over the steps after `after_step` (the warm-up). Each matrix's
    "ns" span covers its batch's whole run, so it counts 1/batch_size of it.
    These include what the span holds beside the Newton-Schulz: the momentum
    step and the Nesterov blend (about 2.5 % at the sweep's sizes)."""
    per_shape: dict[str, list[float]] = {}
    for e in doc["traceEvents"]:
        a = e.get("args") or {}
        if e.get("ph") != "X" or a.get("stage") != "ns" or a.get("step", 0) <= after_step:
            continue
        size = max(int(a.get("batch_size", 1)), 1)
        per_shape.setdefault(a["shape"], []).append(e["dur"] / 1e6 / size)
    return {shape: statistics.median(v) for shape, v in sorted(per_shape.items())}


# OpenBLAS's generic x86 cores, and what dmuond asks for instead on a CPU
# that runs better ones (kernels/blas_core.h, BetterBlasCore: the rule this
# mirrors, so that the kernels timed here are the daemon's).
_GENERIC = {"katmai", "coppermine", "northwood", "prescott", "banias", "core2",
            "penryn", "dunnington", "nehalem", "atom", "sandybridge"}


def use_dmuonds_kernels() -> None:
    """Starts this process again with the OPENBLAS_CORETYPE dmuond would set
    (it does so itself when OpenBLAS picks generic kernels for a CPU model it
    does not know); an OPENBLAS_CORETYPE already set stands, as there."""
    if os.environ.get("OPENBLAS_CORETYPE") or openblas_core().lower() not in _GENERIC:
        return
    with open("/proc/cpuinfo") as f:
        flags = set(next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), []))
    if {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= flags:
        core = "SkylakeX"
    elif {"avx2", "fma"} <= flags:
        core = "Haswell"
    else:
        return
    os.environ["OPENBLAS_CORETYPE"] = core
    # orig_argv keeps the interpreter's own flags (-m, -X, -O), which argv
    # drops: a `python -m ...` run re-executes as itself.
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def openblas_core() -> str:
    """The kernels OpenBLAS chose for this CPU (dmuond, started with the same
    environment, chooses the same): DYNAMIC_ARCH builds detect the CPU at
    load time, $OPENBLAS_CORETYPE overrides them."""
    import ctypes

    try:
        lib = ctypes.CDLL("libopenblas.so.0")  # the one dmuon._dmuon loaded
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return lib.openblas_get_corename().decode()
    except (OSError, AttributeError):
        return "unknown"


if __name__ == "__main__":
    main()

"""The GPU check's test of the Python extension as build_ext.sh built it:
imports the dmuon package from the bundle's python/ (PYTHONPATH, as run.sh
sets it), makes sure the extension it loaded is the one inside that package
(not a checkout's bazel-bin or $DMUON_EXTENSION_DIR), and checks one
orthogonalize() per dtype on a fresh random matrix against an SVD oracle.

Oracle: Newton-Schulz acts on each singular value alone; with
X0 = U / ||U||_F = P S Q^T, NS(U) = P p_k(...p_1(S)) Q^T, p(s) = a s + b s^3
+ c s^5 (the classic coefficients, 5 steps), from numpy's float64 SVD.
Tolerance, derived: a relative perturbation e of X0 moves the result by at
most G e, G the largest slope of the composite polynomial on [0, 1]
(computed here: 485); each product's rounding, a dot product of length up
to k = max(rows, cols), is about sqrt(k) u, u the dtype's unit roundoff.
So tol = G sqrt(k) u: 3.7e-4 (float32) and 6.8e-13 (float64) at k = 160
(measured: about 1.6e-6 and 5e-15). A wrong extension (another matrix, a
stale build, a broken link) is off by 1e-2 or more.

  PYTHONPATH=BUNDLE/python python3 ext_check.py
"""

import os
import sys

import numpy as np

CLASSIC = (3.4445, -4.7750, 2.0315)
STEPS = 5


def oracle(u):
    p, s, qt = np.linalg.svd(u / np.linalg.norm(u), full_matrices=False)
    for _ in range(STEPS):
        a, b, c = CLASSIC
        s = a * s + b * s**3 + c * s**5
    return (p * s) @ qt


def slope():
    """The largest slope of the composite NS polynomial on [0, 1]."""
    x = np.linspace(0.0, 1.0, 200001)
    y = x.copy()
    d = np.ones_like(x)
    a, b, c = CLASSIC
    for _ in range(STEPS):
        d = d * (a + 3 * b * y**2 + 5 * c * y**4)
        y = a * y + b * y**3 + c * y**5
    return float(np.abs(d).max())


def main():
    import dmuon  # from PYTHONPATH: the bundle's package
    from dmuon import _native

    pkg = os.path.dirname(os.path.abspath(dmuon.__file__))
    ext = os.path.abspath(_native.load().__file__)
    print(f"dmuon from {pkg}, extension {ext}")
    if os.path.dirname(ext) != pkg:
        print(f"FAIL: the extension loaded is not the package's own ({ext})")
        return 1
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    rows, cols = 96, 160
    u = rng.standard_normal((rows, cols))
    want = oracle(u)
    g = slope()
    ok = True
    for dtype in (np.float32, np.float64):
        tol = g * np.sqrt(max(rows, cols)) * np.finfo(dtype).eps / 2
        got = dmuon.orthogonalize(u.astype(dtype))
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        good = got.dtype == dtype and got.shape == u.shape and err <= tol
        ok &= good
        print(f"orthogonalize {rows}x{cols} {np.dtype(dtype).name} (seed {seed}): "
              f"rel err vs SVD oracle {err:.2e}, tolerance {tol:.1e} "
              f"(slope {g:.0f}): {'OK' if good else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

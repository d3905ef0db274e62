"""dmuon.orthogonalize against a numpy SVD oracle.

NS acts on each singular value alone: with X0 = U / ||U||_F = P S Q^T,
NS(U) = P p_k(...p_1(S)) Q^T where p(s) = a s + b s^3 + c s^5. The oracle
applies the polynomials to the singular values from numpy's SVD (float64).
"""

import numpy as np
import pytest
import torch

import dmuon

CLASSIC = (3.4445, -4.7750, 2.0315)


def oracle(u, steps):
    u = np.asarray(u, dtype=np.float64)
    p, s, qt = np.linalg.svd(u / max(np.linalg.norm(u), 1e-7), full_matrices=False)
    for a, b, c in steps:
        s = a * s + b * s**3 + c * s**5
    return (p * s) @ qt


def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32), (7, 129)])
@pytest.mark.parametrize("method", ["direct", "gram", "auto"])
def test_matches_svd_oracle(shape, method):
    rng = np.random.default_rng(1)
    u = rng.standard_normal(shape)
    want = oracle(u, [CLASSIC] * 5)
    got32 = dmuon.orthogonalize(u.astype(np.float32), method=method)
    got64 = dmuon.orthogonalize(u, method=method)
    assert got32.dtype == np.float32 and got32.shape == shape
    assert got64.dtype == np.float64
    assert rel(got32, want) < 2e-5
    assert rel(got64, want) < 1e-9


def test_coefficient_lists_batches_and_torch():
    rng = np.random.default_rng(2)
    u = rng.standard_normal((3, 12, 20))
    steps = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]
    got = dmuon.orthogonalize(u, steps=3, coefficients=steps)  # last repeats
    for i in range(3):
        assert rel(got[i], oracle(u[i], steps + steps[-1:])) < 1e-9
    one = dmuon.orthogonalize(u[0], coefficients=CLASSIC, steps=2)
    assert rel(one, oracle(u[0], [CLASSIC] * 2)) < 1e-9
    t = dmuon.orthogonalize(torch.from_numpy(u[1].astype(np.float32)))
    assert isinstance(t, torch.Tensor) and rel(t.numpy(), oracle(u[1], [CLASSIC] * 5)) < 2e-5
    for name in ("classic", "polar_express", "you"):
        s = np.linalg.svd(dmuon.orthogonalize(u[2], coefficients=name), compute_uv=False)
        assert 0.5 < s.min() and s.max() < 1.3, name


def test_errors():
    with pytest.raises(ValueError, match=r"non-finite value \(nan\) at element \(1,2\)"):
        a = np.ones((3, 4), np.float32)
        a[1, 2] = np.nan
        dmuon.orthogonalize(a)
    with pytest.raises(ValueError, match="float32 or float64, got int64"):
        dmuon.orthogonalize(np.ones((3, 3), np.int64))
    with pytest.raises(ValueError, match="2-D matrix or a 3-D batch"):
        dmuon.orthogonalize(np.ones(3))
    with pytest.raises(ValueError, match="method"):
        dmuon.orthogonalize(np.ones((3, 3)), method="svd")
    with pytest.raises(ValueError, match="schedule"):
        dmuon.orthogonalize(np.ones((3, 3)), coefficients="nope")
    with pytest.raises(ValueError, match="triples"):
        dmuon.orthogonalize(np.ones((3, 3)), coefficients=[(1, 2)])

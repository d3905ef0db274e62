"""The dmuon smoke check that test_symbols' and test_wheel's workers run in
fresh interpreters (needs numpy and dmuon only, so a clean venv with the
wheel installed can import it): orthogonalize against an SVD oracle, and
one step of a session on a running dmuond."""

import numpy as np

CLASSIC = (3.4445, -4.7750, 2.0315)


def oracle(u, steps=5):
    """Newton-Schulz (classic coefficients) through numpy's SVD in float64."""
    u = np.asarray(u, dtype=np.float64)
    p, s, qt = np.linalg.svd(u / max(np.linalg.norm(u), 1e-7), full_matrices=False)
    for _ in range(steps):
        s = CLASSIC[0] * s + CLASSIC[1] * s**3 + CLASSIC[2] * s**5
    return (p * s) @ qt


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_orthogonalize(dmuon, rng):
    u = rng.standard_normal((96, 160))  # big enough for the BLAS (gemm, syrk)
    assert rel(dmuon.orthogonalize(u), oracle(u)) < 1e-9
    assert rel(dmuon.orthogonalize(u.astype(np.float32)), oracle(u)) < 2e-5


def check_session_step(dmuon, address, job, rng):
    client = dmuon.Client(address, deadline=10.0)
    s = client.open_session(job, [("w", 24, 40)],
                            groups=[dict(momentum=0.9, nesterov=False)])
    g = rng.standard_normal((24, 40)).astype(np.float32)
    s.gradient(0)[:] = g
    s.gradients_ready([0])
    s.wait_update(0)
    # momentum 0.9, no Nesterov: U = 0.1 G; rows <= cols: lr scale 1.
    assert rel(np.array(s.update(0)), oracle(0.1 * g)) < 2e-5
    s.finish_step()
    s.close()

"""torch's own optimizers as the oracle, side by side with DMuon.

`fp32_muon(monkeypatch)` is torch.optim.Muon with its bf16 Newton–Schulz
swapped for the same iteration in fp32 (as test_torch_muon.py does); every
other line of torch's Muon.step (momentum, Nesterov, lr adjustment, weight
decay, skipping a parameter whose .grad is None) is torch's. `SideBySide`
trains a reference model (that Muon + torch.optim.AdamW) and a copy of it
(DMuon) on the same fresh random inputs and checks every parameter after
every step.

`bf16_reference()` runs the same tests against torch.optim.Muon as shipped
(bf16 Newton–Schulz): fp32_muon() then returns it with every Newton–Schulz
call still torch's own but watched (its distance from the same call in fp32
is recorded), and assert_same() compares how far each parameter moved from
its initial value (pair() records it) at bf16_tol() instead of the
parameters at TOL.
"""

import contextlib
import copy

import pytest
import torch

from helpers import rel_err

_muon = pytest.importorskip("torch.optim._muon", reason="torch.optim.Muon needs torch >= 2.9")

TOL = 1e-5
# torch rounds to bf16 (unit roundoff 2^-8) 3 * ns_steps + 2 = 17 times per
# Newton–Schulz call: r * u = 6.6e-2 relative per update (derived in
# test_torch_muon.test_unpatched_bf16_muon).
BF16_TOL = (3 * 5 + 2) * 2.0 ** -8
_BF16 = {"on": False, "worst": 0.0}
_INITIAL = {}  # id(reference model) -> {name: initial value}
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
# DMuon's names for ADAMW.
DM_ADAMW = dict(adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"],
                adamw_wd=ADAMW["weight_decay"])


def fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """torch's _zeropower_via_newtonschulz, line for line, in fp32."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    a, b, c = ns_coefficients
    x = grad.to(dtype=torch.float32, copy=True)
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


def fp32_muon(monkeypatch):
    if not _BF16["on"]:
        monkeypatch.setattr(_muon, "_zeropower_via_newtonschulz", fp32_newton_schulz)
        return torch.optim.Muon
    shipped = _muon._zeropower_via_newtonschulz

    def watched(grad, ns_coefficients, ns_steps, eps):
        out = shipped(grad, ns_coefficients, ns_steps, eps)  # torch's, as shipped
        exact = fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps)
        _BF16["ns"] = max(_BF16["ns"], rel_err(out.float(), exact))
        return out

    monkeypatch.setattr(_muon, "_zeropower_via_newtonschulz", watched)
    return torch.optim.Muon


def bf16_tol():
    """The tolerance against torch's bf16 Muon (see BF16_TOL)."""
    return max(BF16_TOL, 2.0 * _BF16["ns"])


def tol():
    """The tolerance of the reference in use: TOL, or bf16_tol()."""
    return bf16_tol() if _BF16["on"] else TOL


@contextlib.contextmanager
def bf16_reference():
    """Inside: the reference is torch.optim.Muon as shipped, compared at
    BF16_TOL on each parameter's displacement. Yields a dict whose "worst"
    is the largest relative difference seen."""
    _BF16.update(on=True, worst=0.0, ns=0.0)
    try:
        yield _BF16
    finally:
        _BF16["on"] = False


def pair(make, seed=0):
    torch.manual_seed(seed)
    ref = make()
    _INITIAL[id(ref)] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return ref, copy.deepcopy(ref)


def assert_same(ref_model, dm_model, step, tol=TOL, what=""):
    dm = dict(dm_model.named_parameters())
    initial = _INITIAL.get(id(ref_model)) if _BF16["on"] else None
    if _BF16["on"]:
        tol = bf16_tol()
    for name, p in ref_model.named_parameters():
        # The same numbers in another shape (a conv weight the reference
        # holds flattened) are compared in the reference's shape.
        a, b = dm[name].detach().reshape(p.shape), p.detach()
        if initial is not None and name in initial:
            w0 = initial[name].reshape(p.shape)
            a, b = a - w0, b - w0
        err = rel_err(a, b)
        _BF16["worst"] = max(_BF16["worst"], err)
        assert err < tol, f"{what}step {step + 1}, {name}: {err:.2e} relative"


def muon_adamw_run(model, muon_names, steps, grads_of):
    """torch.optim.Muon (fp32_muon: fp32 Newton–Schulz, MUON) on `model`'s
    parameters named in muon_names and torch.optim.AdamW (ADAMW) on the
    others, in this process, for `steps` steps; grads_of(model, step) puts
    the step's gradients in .grad. Returns (the parameters after every step,
    the gradients of step 1, the Muon momentum_buffers after every step),
    each a list of {name: tensor}."""
    mp = pytest.MonkeyPatch()
    try:
        muon_cls = fp32_muon(mp)
        named = dict(model.named_parameters())
        muon = muon_cls([named[n] for n in muon_names], **MUON)
        adamw = torch.optim.AdamW([p for n, p in named.items() if n not in muon_names],
                                  **ADAMW)
        params, grads, momenta = [], None, []
        for s in range(steps):
            grads_of(model, s)
            if s == 0:
                grads = {n: p.grad.detach().clone() for n, p in named.items()}
            for o in (muon, adamw):
                o.step()
                o.zero_grad()
            params.append({n: p.detach().clone() for n, p in named.items()})
            momenta.append({n: muon.state[named[n]]["momentum_buffer"].clone()
                            for n in muon_names})
        return params, grads, momenta
    finally:
        mp.undo()

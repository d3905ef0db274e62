"""torch's own optimizers as the oracle, side by side with DMuon.

`fp32_muon(monkeypatch)` is torch.optim.Muon with its bf16 Newton–Schulz
swapped for the same iteration in fp32 (as test_torch_muon.py does); every
other line of torch's Muon.step (momentum, Nesterov, lr adjustment, weight
decay, skipping a parameter whose .grad is None) is torch's. `SideBySide`
trains a reference model (that Muon + torch.optim.AdamW) and a copy of it
(DMuon) on the same fresh random inputs and checks every parameter after
every step.
"""

import copy

import pytest
import torch

from helpers import rel_err

_muon = pytest.importorskip("torch.optim._muon", reason="torch.optim.Muon needs torch >= 2.9")

TOL = 1e-5
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
    monkeypatch.setattr(_muon, "_zeropower_via_newtonschulz", fp32_newton_schulz)
    return torch.optim.Muon


def pair(make, seed=0):
    torch.manual_seed(seed)
    ref = make()
    return ref, copy.deepcopy(ref)


def assert_same(ref_model, dm_model, step, tol=TOL, what=""):
    dm = dict(dm_model.named_parameters())
    for name, p in ref_model.named_parameters():
        err = rel_err(dm[name].detach(), p.detach())
        assert err < tol, f"{what}step {step + 1}, {name}: {err:.2e} relative"

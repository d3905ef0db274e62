"""Training loops of every shape torch's optimizers allow, DMuon against
torch.optim.Muon (fp32 Newton–Schulz) + AdamW, every parameter after every
iteration at 1e-5 relative (torch_ref.py):

- a backward whose step() is skipped, then zero_grad() and a normal step;
- two losses, a backward each, one step (torch sums the gradients);
- gradient accumulation the torch way (N backwards, then step, no no_sync);
- a GAN: two optimizers, each loss backpropagates through both models;
- zero_grad() after a hand-off and before step(): only the new gradients.
"""

import pytest
import torch
from torch import nn

from dmuon.optim import DMuon
from torch_ref import ADAMW, DM_ADAMW, MUON, assert_same, fp32_muon, pair

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self, d_in=10, d=16, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d)
        self.ln = nn.LayerNorm(d)
        self.fc2 = nn.Linear(d, d)
        self.out = nn.Linear(d, d_out)

    def forward(self, x):
        h = self.ln(nn.functional.gelu(self.fc1(x)))
        return self.out(nn.functional.gelu(self.fc2(h)))


def _batch(k, n=16, d_in=10, d_out=4):
    g = torch.Generator().manual_seed(500 + k)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def _loss(model, k):
    x, y = _batch(k)
    return nn.functional.mse_loss(model(x), y)


class _Ref:
    """torch.optim.Muon (2-D parameters) + AdamW (the rest), one optimizer's
    step() and zero_grad()."""

    def __init__(self, monkeypatch, model):
        # DMuon's routing: matrices to Muon, but a Linear weight with a dim of
        # 1 (D's output layer) to AdamW.
        mats = [p for p in model.parameters() if p.dim() == 2 and min(p.shape) > 1]
        others = [p for p in model.parameters() if not (p.dim() == 2 and min(p.shape) > 1)]
        self.opts = [fp32_muon(monkeypatch)(mats, **MUON), torch.optim.AdamW(others, **ADAMW)]

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.opts:
            o.zero_grad(set_to_none)


def _side_by_side(monkeypatch, daemon, iteration, iterations=8, make=Net):
    """Runs iteration(model, opt, k) on the reference and on DMuon and
    compares them after each."""
    ref, dm = pair(make, seed=4)
    ref_opt = _Ref(monkeypatch, ref)
    opt = DMuon(dm, **MUON, **DM_ADAMW, server=daemon.address)
    try:
        for k in range(iterations):
            iteration(ref, ref_opt, k)
            iteration(dm, opt, k)
            assert_same(ref, dm, k)
    finally:
        opt.close()
    return opt


def test_skip_a_step(monkeypatch, daemon):
    """Every third iteration's backward has no step (e.g. a loss spike the
    loop skips): zero_grad() drops it, and the next step uses only its own
    gradients."""

    def iteration(model, opt, k):
        if k % 3 == 1:
            _loss(model, 1000 + k).backward()  # no step() for this one
            opt.zero_grad()
        _loss(model, k).backward()
        opt.step()
        opt.zero_grad()

    _side_by_side(monkeypatch, daemon, iteration)


def test_two_backwards_per_step(monkeypatch, daemon):
    """Two losses, one backward each, one step: the gradients add up."""

    def iteration(model, opt, k):
        _loss(model, k).backward()
        (0.5 * _loss(model, 2000 + k)).backward()
        opt.step()
        opt.zero_grad()

    _side_by_side(monkeypatch, daemon, iteration)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_accumulation_the_torch_way(monkeypatch, daemon, set_to_none):
    """Four micro-batches, a backward each, then one step (no no_sync)."""

    def iteration(model, opt, k):
        for m in range(4):
            (_loss(model, 10 * k + m) / 4).backward()
        opt.step()
        opt.zero_grad(set_to_none)

    _side_by_side(monkeypatch, daemon, iteration, iterations=5)


def test_zero_grad_cancels_a_handoff(monkeypatch, daemon):
    """A backward hands gradients off, zero_grad() before step(), a new
    backward: the step uses only the new gradients. Also zero_grad() then
    step() without a backward: nothing has a gradient, nothing moves."""

    def iteration(model, opt, k):
        _loss(model, 3000 + k).backward()
        opt.zero_grad()
        if k % 4 == 3:
            opt.step()  # no gradient at all: torch skips every parameter
            return
        _loss(model, k).backward()
        opt.step()
        opt.zero_grad()

    _side_by_side(monkeypatch, daemon, iteration)


class _G(nn.Module):
    def __init__(self, z=6, d=12, out=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(z, d), nn.Linear(d, out)

    def forward(self, z):
        return self.fc2(torch.tanh(self.fc1(z)))


class _D(nn.Module):
    def __init__(self, d_in=8, d=12):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, d), nn.Linear(d, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def test_gan_two_optimizers(monkeypatch, daemon):
    """D's loss backpropagates through G's parameters and G's through D's;
    each optimizer zeroes and steps only its own model."""
    torch.manual_seed(9)
    g_ref, g_dm = pair(_G, seed=9)
    d_ref, d_dm = pair(_D, seed=10)
    ref_g, ref_d = _Ref(monkeypatch, g_ref), _Ref(monkeypatch, d_ref)
    opt_g = DMuon(g_dm, **MUON, **DM_ADAMW, server=daemon.address)
    opt_d = DMuon(d_dm, **MUON, **DM_ADAMW, server=daemon.address)

    def iteration(g, d, og, od, k):
        gen = torch.Generator().manual_seed(700 + k)
        real = torch.randn(16, 8, generator=gen) + 1.0
        z1, z2 = torch.randn(16, 6, generator=gen), torch.randn(16, 6, generator=gen)
        od.zero_grad()
        d_loss = nn.functional.softplus(-d(real)).mean() + nn.functional.softplus(
            d(g(z1))).mean()  # not detached: G's parameters get gradients too
        d_loss.backward()
        od.step()
        og.zero_grad()
        g_loss = nn.functional.softplus(-d(g(z2))).mean()  # D's get gradients too
        g_loss.backward()
        og.step()

    try:
        for k in range(6):
            iteration(g_ref, d_ref, ref_g, ref_d, k)
            iteration(g_dm, d_dm, opt_g, opt_d, k)
            assert_same(g_ref, g_dm, k, what="G ")
            assert_same(d_ref, d_dm, k, what="D ")
    finally:
        opt_g.close()
        opt_d.close()

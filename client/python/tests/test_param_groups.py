"""add_param_group, opt.state[p]["momentum_buffer"] and LR schedulers,
side by side with torch.optim.Muon (fp32 Newton–Schulz) + AdamW."""

import pytest
import torch
from torch import nn

from dmuon.optim import DMuon
from helpers import rel_err
from torch_ref import DM_ADAMW, MUON, ADAMW, assert_same, fp32_muon, pair

pytestmark = pytest.mark.timeout(60)


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 16))
        self.extra = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
        self.out = nn.Linear(16, 6)

    def forward(self, x):
        h = self.body(x)
        return self.out(nn.functional.gelu(h + self.extra(h)))


def _split(params):
    params = list(params)
    return [p for p in params if p.dim() == 2], [p for p in params if p.dim() != 2]


def _step(model, step):
    g = torch.Generator().manual_seed(700 + step)
    x, y = torch.randn(32, 12, generator=g), torch.randint(0, 6, (32,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()


def test_add_param_group_and_momentum_buffer(monkeypatch, daemon):
    ref, dm = pair(Two, seed=5)
    first = [*ref.body.parameters(), *ref.out.parameters()]
    mats, others = _split(first)
    muon = fp32_muon(monkeypatch)(mats, **MUON)
    adamw = torch.optim.AdamW(others, **ADAMW)
    opt = DMuon([*dm.body.parameters(), *dm.out.parameters()], model=dm, **MUON,
                **DM_ADAMW, server=daemon.address)
    for step in range(8):
        if step == 3:  # the extra block joins, with its own Muon lr
            mats, others = _split(ref.extra.parameters())
            muon.add_param_group({"params": mats, "lr": 0.01})
            adamw.add_param_group({"params": others})
            opt.add_param_group({"params": list(dm.extra.parameters()), "lr": 0.01})
            assert opt.session.names == ["body.0.weight", "body.2.weight", "out.weight",
                                         "extra.0.weight"]
            assert [g["lr"] for g in opt.param_groups] == [0.02, 3e-3, 0.01, 3e-3]
        _step(ref, step)
        muon.step(), adamw.step(), muon.zero_grad(), adamw.zero_grad()
        _step(dm, step)
        opt.step()
        opt.zero_grad()
        assert_same(ref, dm, step)
    assert opt.state_dict()["dmuon"]["completed_steps"] == 8
    names = dict(dm.named_parameters())
    for name, p in ref.named_parameters():
        if p.dim() == 2:
            want = muon.state[p]["momentum_buffer"]
            got = opt.state[names[name]]["momentum_buffer"]
            assert got.shape == p.shape and rel_err(got, want) < 1e-5, name
            assert "momentum_buffer" in opt.state[names[name]]
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [dm.out.weight]})
    opt.close()


def test_one_cycle_lr_over_both_halves(monkeypatch, daemon):
    """One OneCycleLR over DMuon's groups (max_lr per group) == one over
    each of torch's optimizers. Momentum is fixed in dmuond, so
    cycle_momentum must be False (True: the next test)."""
    ref, dm = pair(Two, seed=6)
    mats, others = _split(ref.parameters())
    muon = fp32_muon(monkeypatch)(mats, **MUON)
    adamw = torch.optim.AdamW(others, **ADAMW)
    opt = DMuon(dm, **MUON, **DM_ADAMW, server=daemon.address)
    kw = dict(total_steps=10, pct_start=0.3, cycle_momentum=False)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(muon, max_lr=0.04, **kw),
              torch.optim.lr_scheduler.OneCycleLR(adamw, max_lr=6e-3, **kw)]
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.04, 6e-3], **kw)
    for step in range(10):
        _step(ref, step)
        muon.step(), adamw.step(), muon.zero_grad(), adamw.zero_grad()
        _step(dm, step)
        opt.step()
        opt.zero_grad()
        for s in (*scheds, sched):
            s.step()
        assert_same(ref, dm, step)
    assert [g["lr"] for g in opt.param_groups] == [muon.param_groups[0]["lr"],
                                                   adamw.param_groups[0]["lr"]]
    opt.close()


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.04, total_steps=10),
    lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.04,
                                                step_size_up=2)],
    ids=["OneCycleLR", "CyclicLR"])
def test_cycled_momentum_is_refused_at_step_and_nothing_changes(daemon, make):
    """cycle_momentum=True (both schedulers' default) sets a momentum per step
    that dmuond cannot take (fixed at OpenSession; no protocol field): the
    scheduler can be made, and step() raises naming it and the remedy
    before anything changes; without the scheduler's keys DMuon goes on."""
    torch.manual_seed(0)
    dm = Two()
    opt = DMuon(dm, **MUON, **DM_ADAMW, server=daemon.address)
    sched = make(opt)
    before = {n: p.detach().clone() for n, p in dm.named_parameters()}
    _step(dm, 0)
    with pytest.raises(ValueError, match=r"OneCycleLR or CyclicLR.*cycle_momentum=False"):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in dm.named_parameters())
    del sched
    for g in opt.param_groups:
        for k in ("base_momentum", "max_momentum"):
            g.pop(k, None)
        if g["use_muon"]:
            g["momentum"] = MUON["momentum"]
        else:
            g.pop("momentum", None)
    opt.zero_grad()
    _step(dm, 0)
    opt.step()
    assert opt.state_dict()["dmuon"]["completed_steps"] == 1
    opt.close()

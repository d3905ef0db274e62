"""add_param_group, opt.state[p]["momentum_buffer"] and LR schedulers,
side by side with torch.optim.Muon (fp32 Newton–Schulz) + AdamW."""

import pytest
import torch
from torch import nn

from dmuon.optim import DMuon
from helpers import rel_err
from torch_ref import DM_ADAMW, MUON, ADAMW, assert_same, fp32_muon, pair, tol

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


def _iteration(ref, dm, muon, adamw, opt, step, scheds=()):
    """One training step side by side: torch's Muon + AdamW on ref, DMuon on
    dm, then every scheduler of `scheds`; the models must agree after it."""
    _step(ref, step)
    muon.step(), adamw.step(), muon.zero_grad(), adamw.zero_grad()
    _step(dm, step)
    opt.step()
    opt.zero_grad()
    for s in scheds:
        s.step()
    assert_same(ref, dm, step)


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
        _iteration(ref, dm, muon, adamw, opt, step)
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
    each of torch's optimizers (cycle_momentum=False; True: the next tests)."""
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
        _iteration(ref, dm, muon, adamw, opt, step, (*scheds, sched))
    assert [g["lr"] for g in opt.param_groups] == [muon.param_groups[0]["lr"],
                                                   adamw.param_groups[0]["lr"]]
    opt.close()


# (DMuon's scheduler, torch.optim.Muon's, torch.optim.AdamW's): the same
# settings, max_lr (and base_lr) per group for DMuon's Muon and AdamW groups.
CYCLED = {
    "OneCycleLR": lambda o, lrs: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=lrs, total_steps=10, pct_start=0.3),
    "CyclicLR": lambda o, lrs: torch.optim.lr_scheduler.CyclicLR(
        o, base_lr=[x / 4 for x in lrs] if isinstance(lrs, list) else lrs / 4,
        max_lr=lrs, step_size_up=3),
}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at_step"])
@pytest.mark.parametrize("kind", sorted(CYCLED))
def test_cycled_momentum_matches_torch(monkeypatch, daemon, kind, overlap):
    """cycle_momentum=True (both schedulers' default) sets each group's
    momentum every step: DMuon's Muon groups send it to dmuond with the
    step's hand-offs (GradientsReady.momentum), its AdamW groups take it as
    beta1, as torch.optim.Muon + AdamW each with its own scheduler do."""
    make = CYCLED[kind]
    ref, dm = pair(Two, seed=8)
    mats, others = _split(ref.parameters())
    muon = fp32_muon(monkeypatch)(mats, **MUON)
    adamw = torch.optim.AdamW(others, **ADAMW)
    opt = DMuon(dm, **MUON, **DM_ADAMW, server=daemon.address, overlap=overlap)
    scheds = [make(muon, 0.04), make(adamw, 6e-3)]
    sched = make(opt, [0.04, 6e-3])
    seen = set()
    for step in range(10):
        assert opt.param_groups[0]["momentum"] == muon.param_groups[0]["momentum"]
        assert opt.param_groups[1]["momentum"] == adamw.param_groups[0]["betas"][0]
        seen.add(muon.param_groups[0]["momentum"])
        _iteration(ref, dm, muon, adamw, opt, step, (*scheds, sched))
        assert opt.param_groups[1]["betas"][1] == ADAMW["betas"][1]
    assert len(seen) > 3  # the momentum did cycle
    names = dict(dm.named_parameters())
    for name, p in ref.named_parameters():
        if p.dim() == 2:
            want = muon.state[p]["momentum_buffer"]
            assert rel_err(opt.state[names[name]]["momentum_buffer"], want) < tol(), name
    assert opt.stats.get("redone_steps", 0) == 0
    opt.close()


def test_cycled_momentum_resumes_from_a_checkpoint(monkeypatch, daemon):
    """A checkpoint taken mid-cycle (the groups' momentum is the cycled one)
    loads into a new DMuon created with the default momentum and a new
    scheduler, and the run goes on as torch's."""
    ref, dm = pair(Two, seed=10)
    mats, others = _split(ref.parameters())
    muon = fp32_muon(monkeypatch)(mats, **MUON)
    adamw = torch.optim.AdamW(others, **ADAMW)
    make = CYCLED["OneCycleLR"]
    scheds = [make(muon, 0.04), make(adamw, 6e-3)]
    opt = DMuon(dm, **MUON, **DM_ADAMW, server=daemon.address)
    sched = make(opt, [0.04, 6e-3])
    for step in range(10):
        if step == 4:
            sd, ssd = opt.state_dict(), sched.state_dict()
            assert sd["param_groups"][0]["momentum"] != MUON["momentum"]
            opt.close()
            opt = DMuon(dm, **MUON, **DM_ADAMW, server=daemon.address)
            sched = make(opt, [0.04, 6e-3])
            opt.load_state_dict(sd)
            sched.load_state_dict(ssd)
        _iteration(ref, dm, muon, adamw, opt, step, (*scheds, sched))
    opt.close()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
@pytest.mark.filterwarnings("ignore:DMuon. Muon gradients were changed")
def test_momentum_changed_after_the_handoff_is_redone(monkeypatch, daemon):
    """A scheduler stepped between backward (which handed the gradients off
    with the old momentum, overlap=True) and step(): the step is computed
    again with the new one (one process, host buffers: a Rewind), exactly as
    torch's step() reads the group then."""
    ref, dm = pair(Two, seed=9)
    mats, others = _split(ref.parameters())
    muon = fp32_muon(monkeypatch)(mats, **MUON)
    adamw = torch.optim.AdamW(others, **ADAMW)
    opt = DMuon(dm, **MUON, **DM_ADAMW, server=daemon.address, overlap=True)
    make = CYCLED["OneCycleLR"]
    scheds = [make(muon, 0.04), make(adamw, 6e-3)]
    sched = make(opt, [0.04, 6e-3])
    for step in range(6):
        _step(ref, step)
        _step(dm, step)
        for s in (*scheds, sched):  # before the optimizers' step
            s.step()
        muon.step(), adamw.step(), muon.zero_grad(), adamw.zero_grad()
        opt.step()
        opt.zero_grad()
        assert_same(ref, dm, step)
    assert opt.stats["redone_steps"] >= 4
    opt.close()


def test_bad_momentum_is_refused_by_dmuond_and_by_dmuon(daemon):
    """Through the low-level client a momentum outside [0, 1) or NaN reaches
    dmuond, which ends the step naming the parameter and the value; DMuon
    refuses one in its groups at step() before anything changes."""
    import dmuon

    np = pytest.importorskip("numpy")
    for bad, text in ((1.5, "1.5"), (float("nan"), "nan")):
        c = dmuon.Client(daemon.address, deadline=10.0)
        s = c.open_session(f"bad-momentum-{text}", [("w", 8, 12)])
        s.gradient(0)[:] = np.ones((8, 12), np.float32)
        with pytest.raises(dmuon.Error) as e:
            s.gradients_ready([0], momentum=[bad])
            s.wait_update(0)
        assert "parameter 'w'" in str(e.value) and f"got {text}" in str(e.value)
        assert "must be in [0, 1)" in str(e.value)
        with pytest.raises(Exception, match=r"momentum values for 1 parameters"):
            s.gradients_ready([0], momentum=[0.5, 0.5])
        s.close()
    torch.manual_seed(0)
    dm = Two()
    opt = DMuon(dm, **MUON, **DM_ADAMW, server=daemon.address, overlap=False)
    before = {n: p.detach().clone() for n, p in dm.named_parameters()}
    opt.param_groups[0]["momentum"] = 1.5
    _step(dm, 0)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['momentum'\] is 1.5; it "
                                         r"must be in \[0, 1\)"):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in dm.named_parameters())
    opt.param_groups[0]["momentum"] = 0.9
    opt.step()
    assert opt.state_dict()["dmuon"]["completed_steps"] == 1
    opt.close()

"""A parameter whose .grad is None in a step, against torch.optim.Muon.

torch.optim.Muon and AdamW skip such a parameter: no weight decay, no
momentum change, no update. DMuon does the same in both halves: a Muon matrix
is declared absent to dmuond (GradientsReady.absent_param_ids, protocol minor
1), which computes nothing for it and leaves its momentum as it is, so a
matrix that misses a step after it has trained stays exact too.
"""
import warnings


import pytest
import torch
from torch import nn

from dmuon.optim import DMuon
from torch_ref import DM_ADAMW, MUON, ADAMW, assert_same, fp32_muon, pair

pytestmark = pytest.mark.timeout(60)


class Branchy(nn.Module):
    """A trunk, a conditional branch (Linear + LayerNorm with biases), a head."""

    def __init__(self, d_in=12, d=16, classes=6):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d)
        self.branch = nn.Linear(d, d)
        self.branch_ln = nn.LayerNorm(d)
        self.fc2 = nn.Linear(d, d)
        self.out = nn.Linear(d, classes)

    def forward(self, x, use_branch):
        h = nn.functional.gelu(self.fc1(x))
        if use_branch:
            h = h + self.branch_ln(nn.functional.gelu(self.branch(h)))
        return self.out(nn.functional.gelu(self.fc2(h)))


def _loss(model, step, use_branch):
    g = torch.Generator().manual_seed(1000 + step)  # fresh random inputs each step
    x, y = torch.randn(32, 12, generator=g), torch.randint(0, 6, (32,), generator=g)
    return nn.functional.cross_entropy(model(x, use_branch), y)


class ShmAsNccl:
    """The nccl region's side of DMuon's hand-off over a host (shm) session,
    for a machine without a GPU: DMuon then declares, receives and applies as
    over nccl (each send with its declaration, one receive per announcement
    before an update is applied), while the bytes travel in the shm segment.
    Records what would have been sent and received."""

    kind = "nccl"

    def __init__(self):
        self.sent, self.received = [], []

    def handed(self, ids):  # nccl: one ncclSend group of these gradients
        self.sent.extend(ids)

    def receive(self, ids):  # nccl: one ncclRecv group of these updates
        self.received.extend(ids)


def _train(monkeypatch, daemon, schedule, freeze=(), region=None):
    ref, dm = pair(Branchy, seed=3)
    for model in (ref, dm):
        for name in freeze:
            model.get_parameter(name).requires_grad_(False)
    mats = [p for n, p in ref.named_parameters() if p.dim() == 2]
    others = [p for n, p in ref.named_parameters() if p.dim() != 2]
    muon = fp32_muon(monkeypatch)(mats, **MUON)
    adamw = torch.optim.AdamW(others, **ADAMW)
    opt = DMuon(dm, **MUON, **DM_ADAMW, server=daemon.address)
    opt._handoff.link.region = region  # None: the shm session's own
    assert {r["name"] for r in opt.routing if r["route"] == "muon"} == {
        "fc1.weight", "branch.weight", "fc2.weight", "out.weight"}
    before = {}
    for step, use_branch in enumerate(schedule):
        if step == len(schedule) // 3:
            for model in (ref, dm):
                for name in freeze:  # unfrozen: it trains from now on
                    model.get_parameter(name).requires_grad_(True)
        before = {n: p.detach().clone() for n, p in dm.named_parameters()}
        _loss(ref, step, use_branch).backward()
        muon.step(), adamw.step(), muon.zero_grad(), adamw.zero_grad()
        _loss(dm, step, use_branch).backward()
        opt.step()
        opt.zero_grad()
        assert_same(ref, dm, step)
        if not use_branch:  # not decayed, not updated
            for n in ("branch.weight", "branch.bias", "branch_ln.weight"):
                assert torch.equal(dm.get_parameter(n).detach(), before[n]), (step, n)
        if region is not None:  # nothing sent or received for an absent one
            branch = opt._table.index[id(dm.branch.weight)]
            n = len(opt._table.muon)
            want = [i for i in range(n) if use_branch or i != branch]
            assert sorted(region.sent) == want, (step, region.sent)
            assert sorted(region.received) == want, (step, region.received)
            region.sent, region.received = [], []
    opt._handoff.link.region = None
    opt.close()
    return opt


def test_branch_without_gradient_until_it_is_used(monkeypatch, daemon):
    """Absent for the first steps (both halves skipped: no decay, no update),
    then used: equal to torch every step."""
    _train(monkeypatch, daemon, [False] * 4 + [True] * 8)


def test_frozen_at_construction_unfrozen_later(monkeypatch, daemon):
    """Frozen Muon and AdamW parameters keep their module's route and start
    training when unfrozen, as with torch's optimizers."""
    _train(monkeypatch, daemon, [True] * 12, freeze=("fc2.weight", "fc2.bias"))


def test_missing_gradient_after_training_is_exact_and_silent(monkeypatch, daemon):
    """A matrix with momentum that misses steps: its momentum stays (dmuond
    is told it is absent), equal to torch every step, with no warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*has no gradient", category=RuntimeWarning)
        opt = _train(monkeypatch, daemon, [True] * 3 + [False, False, True, True])
    assert opt.stats["steps"] == 7


def test_branch_used_every_other_step(monkeypatch, daemon):
    _train(monkeypatch, daemon, [True, False] * 6)


def test_missing_gradient_over_nccl_is_declared_absent(monkeypatch, daemon):
    """Over nccl too (dmuond takes absent parameters there: no send, no
    receive for them): a matrix with momentum that misses steps keeps it,
    equal to torch every step, with no warning and no zero gradient sent."""
    region = ShmAsNccl()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=RuntimeWarning)
        opt = _train(monkeypatch, daemon, [True] * 3 + [False, False, True, False, True],
                     region=region)
    assert opt.stats["steps"] == 8


def test_an_older_daemon_refusing_absent_over_nccl_is_explained():
    """A dmuond from before absent parameters over nccl refuses them
    (UNIMPLEMENTED, asking for zeros, which this client no longer sends): the
    error says the daemon is older and what to do."""
    from dmuon import _errors, _native
    e = _native.load().Error(
        "parameter 'branch.weight' declared absent at step 3: TRANSPORT_NCCL does "
        "not take absent parameters yet; send a zero gradient")
    e.code = "UNIMPLEMENTED"
    with pytest.raises(_native.load().Error) as got:
        with _errors.explained(None):
            raise e
    assert got.value is not e and got.value.code == "UNIMPLEMENTED"
    assert "older than this client" in str(got.value)
    assert "Upgrade dmuond" in str(got.value)
    assert "'branch.weight' declared absent at step 3" in str(got.value)

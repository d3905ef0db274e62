"""Gradients edited after backward() with overlap on (the default): what
torch.optim.Muon + AdamW would do with the edited gradients, to 1e-5 per
parameter every step. clip_grad_norm_, GradScaler (unscale_ every step, and a
step it skips on inf), and a non-uniform edit (masking): DMuon sees that a
handed-off .grad changed at step(), has dmuond undo the step it computed
(Rewind) and hands the gradients off again.
"""

import pytest
import torch
from torch import nn

from dmuon.optim import DMuon
from torch_ref import ADAMW, DM_ADAMW, MUON, TOL, assert_same, fp32_muon, pair

STEPS = 8


def make():
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 24), nn.Tanh(),
                         nn.Linear(24, 4))


def reference(Muon, model):
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [Muon(mats, **MUON), torch.optim.AdamW(rest, **ADAMW)]


def loss_of(model, step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 16, generator=g)
    y = torch.randn(32, 4, generator=g)
    return ((model(x) - y) ** 2).mean()


def run(daemon, monkeypatch, edit, steps=STEPS, scaler=None, inf_steps=()):
    """Trains the reference (fp32-NS torch Muon + AdamW) and DMuon side by
    side; `edit(model, step)` runs after backward() on both."""
    ref_model, dm_model = pair(make)
    ref_opts = reference(fp32_muon(monkeypatch), ref_model)
    opt = DMuon(dm_model, server=daemon.address, **MUON, **DM_ADAMW)
    scalers = (None, None) if scaler is None else (scaler(), scaler())
    try:
        for step in range(steps):
            for model, opts, sc in ((ref_model, ref_opts, scalers[0]),
                                    (dm_model, [opt], scalers[1])):
                loss = loss_of(model, step)
                if step in inf_steps:
                    loss = loss * float("inf")
                if sc is None:
                    loss.backward()
                    edit(model, step)
                    for o in opts:
                        o.step()
                else:
                    sc.scale(loss).backward()
                    for o in opts:
                        sc.unscale_(o)
                    edit(model, step)
                    for o in opts:
                        sc.step(o)
                    sc.update()
                for o in opts:
                    o.zero_grad()
            assert_same(ref_model, dm_model, step)
        return opt.stats
    finally:
        opt.close()


def test_clip_grad_norm_with_overlap(daemon, monkeypatch):
    # 0.05 clips every step; 1e9 never does (clip_grad_norm_ still multiplies
    # every gradient in place, by exactly 1.0: no bit changes, no redo).
    stats = run(daemon, monkeypatch,
                lambda m, s: nn.utils.clip_grad_norm_(m.parameters(), 0.05))
    assert stats["redone_steps"] == STEPS
    stats = run(daemon, monkeypatch,
                lambda m, s: nn.utils.clip_grad_norm_(m.parameters(), 1e9))
    assert stats["redone_steps"] == 0


def test_clip_only_some_steps(daemon, monkeypatch):
    stats = run(daemon, monkeypatch, lambda m, s: nn.utils.clip_grad_norm_(
        m.parameters(), 0.05 if s % 3 == 1 else 1e9))
    assert stats["redone_steps"] == len([s for s in range(STEPS) if s % 3 == 1])


def test_grad_scaler_with_inf_skip(daemon, monkeypatch):
    """GradScaler("cpu"): unscale_ after the hand-off every step, and steps 2
    and 3 skipped on inf (torch never calls optimizer.step(): dmuond's step of
    that backward is undone, momentum untouched)."""
    scaler = lambda: torch.amp.GradScaler("cpu", init_scale=1024.0,  # noqa: E731
                                          growth_interval=2)
    stats = run(daemon, monkeypatch, lambda m, s: None, scaler=scaler,
                inf_steps=(2, 3))
    assert stats["steps"] == STEPS - 2
    assert stats["rewound_steps"] >= 2


def test_grad_scaler_with_clipping(daemon, monkeypatch):
    scaler = lambda: torch.amp.GradScaler("cpu", init_scale=256.0)  # noqa: E731
    run(daemon, monkeypatch, lambda m, s: nn.utils.clip_grad_norm_(m.parameters(), 0.05),
        scaler=scaler, inf_steps=(4,))


def test_non_uniform_edit_is_detected_and_taken(daemon, monkeypatch):
    """Masking half of one matrix's gradient: not a uniform scale; detected at
    step() and the edited gradient is what dmuond computes with."""
    def mask(model, step):
        if step % 2 == 0:
            g = model[2].weight.grad
            g[: g.shape[0] // 2] = 0

    stats = run(daemon, monkeypatch, mask)
    assert stats["redone_steps"] == (STEPS + 1) // 2


def test_replaced_grad_is_detected(daemon, monkeypatch):
    """A new .grad tensor (not an in-place edit) is seen too."""
    def double(model, step):
        model[0].weight.grad = model[0].weight.grad * 2

    stats = run(daemon, monkeypatch, double, steps=4)
    assert stats["redone_steps"] == 4


@pytest.mark.parametrize("transport", ["inline"])
def test_clip_over_inline(daemon, monkeypatch, transport):
    ref_model, dm_model = pair(make)
    ref_opts = reference(fp32_muon(monkeypatch), ref_model)
    opt = DMuon(dm_model, server=daemon.address, transport=transport, **MUON, **DM_ADAMW)
    try:
        for step in range(4):
            for model, opts in ((ref_model, ref_opts), (dm_model, [opt])):
                loss_of(model, step).backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                for o in opts:
                    o.step()
                    o.zero_grad()
            assert_same(ref_model, dm_model, step)
        assert opt.stats["redone_steps"] == 4
    finally:
        opt.close()


def test_same_bits_compares_bits_not_values():
    """The edit check's comparison (_handoff.same_bits) on fresh random
    gradients: a copy is the same; one ulp, a zero's sign or another NaN
    payload is an edit (torch.equal would call -0.0 equal to 0.0, and a NaN
    never equal to itself, so a NaN gradient would be redone every step)."""
    from dmuon import _native
    from dmuon._handoff import same_bits

    g = torch.randn(37, 53)
    buf = g.clone()
    assert same_bits(g, buf)
    for flat in (g.view(-1), g.t().contiguous().t()):  # reshaped; not contiguous
        assert same_bits(flat, buf)
    bits = buf.view(torch.int32).view(-1)
    k = int(torch.randint(0, bits.numel(), ()))
    for change in (1, -1, 1 << 31):  # one ulp either way; the sign bit
        bits[k] += change
        assert not same_bits(g, buf)
        assert not same_bits(g.t().contiguous().t(), buf)
        bits[k] -= change
    zero = torch.zeros(4, 4)
    assert not same_bits(zero, -zero)
    nan = torch.full((4, 4), float("nan"))
    assert same_bits(nan, nan.clone())
    other = nan.clone()
    other.view(torch.int32)[1, 2] += 1  # still a NaN, other bits
    assert not same_bits(nan, other)
    half = torch.randn(8, 8, dtype=torch.bfloat16)  # handed off as float32
    assert same_bits(half, half.float())
    assert not same_bits(half, half.float() * 2)
    for dtype, as_int in ((torch.float64, torch.int64), (torch.bfloat16, torch.int16)):
        # A buffer of another element size: its own integer view, bit by bit.
        wide = torch.randn(6, 7, dtype=dtype)
        assert same_bits(wide.t().contiguous().t(), wide.clone())
        flipped = wide.clone()
        flipped.view(as_int)[2, 3] ^= 1
        assert not same_bits(wide.t().contiguous().t(), flipped)
    ext = _native.load()
    with pytest.raises(ValueError, match="not C-contiguous"):
        ext.same_bytes(g.t().numpy(), buf.t().contiguous().numpy())
    assert not ext.same_bytes(g.numpy(), buf[:-1].numpy())  # other sizes

"""DMuon through a real dmuond vs the independent reference Muon (fp32)."""

import copy

import pytest
import torch

from dmuon import RoutingOptions
from dmuon.optim import DMuon
from helpers import (MLP, ReferenceMuon, TinyLM, lm_batch, max_rel_err, mlp_batch,
                     muon_split, train)

STEPS = 20
TOL = 1e-5


def run_pair(daemon, make_model, batch_fn, adjust_lr_fn, nesterov, adamw_modules,
             **extra):
    torch.manual_seed(0)
    ref_model = make_model()
    dm_model = copy.deepcopy(ref_model)
    hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov,
                 adjust_lr_fn=adjust_lr_fn)
    mats, others = muon_split(ref_model, adamw_modules(ref_model))
    ref = ReferenceMuon(mats, others, adamw_lr=3e-3, **hyper)
    opt = DMuon(dm_model, server=daemon.address, adamw_lr=3e-3,
                adamw=adamw_modules(dm_model), **hyper, **extra)
    ref_losses = train(ref_model, ref, STEPS, batch_fn)
    dm_losses = train(dm_model, opt, STEPS, batch_fn)
    opt.close()
    return ref_model, dm_model, ref_losses, dm_losses


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_mlp_matches_reference(daemon, adjust_lr_fn, nesterov):
    ref, dm, ref_l, dm_l = run_pair(daemon, MLP, mlp_batch, adjust_lr_fn, nesterov,
                                    lambda m: ())
    assert max_rel_err(dm, ref) < TOL
    assert ref_l[-1] < ref_l[0]  # it trains
    assert max(abs(a - b) / abs(b) for a, b in zip(dm_l, ref_l)) < TOL


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_transformer_matches_reference(daemon, adjust_lr_fn, nesterov):
    ref, dm, ref_l, dm_l = run_pair(daemon, TinyLM, lm_batch, adjust_lr_fn, nesterov,
                                    lambda m: [m.head])
    assert max_rel_err(dm, ref) < TOL
    assert ref_l[-1] < ref_l[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(dm_l, ref_l)) < TOL


def test_inline_transport_and_overlap_off_match(daemon):
    """Transports and hand-off modes change nothing in the numbers."""
    base = run_pair(daemon, TinyLM, lm_batch, None, True, lambda m: [m.head])[1]
    for extra in (dict(transport="inline"), dict(overlap=False)):
        other = run_pair(daemon, TinyLM, lm_batch, None, True, lambda m: [m.head],
                         **extra)[1]
        for (n, a), b in zip(base.named_parameters(), other.parameters()):
            assert torch.equal(a, b), (extra, n)


@pytest.mark.parametrize("overlap_forward", [False, True])
def test_stream_messages_match_the_doorbell(daemon, monkeypatch,
                                            overlap_forward):
    """$DMUON_DOORBELL=0: gradients declared and updates announced by Step
    messages instead of the shm segment's doorbell (docs/protocol.md
    "Doorbell"); the same numbers, bit for bit."""
    models = {}
    for value in ("1", "0"):
        monkeypatch.setenv("DMUON_DOORBELL", value)
        torch.manual_seed(2)
        model = TinyLM()
        opt = DMuon(model, lr=0.02, server=daemon.address,
                    routing_options=RoutingOptions(adamw=[model.head]),
                    overlap_forward=overlap_forward)
        assert opt.transport == "shm"
        assert opt.session.doorbell == (value == "1")
        train(model, opt, 6, lm_batch)
        opt.synchronize()
        opt.close()
        models[value] = model
    for (n, a), b in zip(models["1"].named_parameters(),
                         models["0"].parameters()):
        assert torch.equal(a, b), n


def test_doorbell_variable_is_checked(daemon, monkeypatch):
    monkeypatch.setenv("DMUON_DOORBELL", "yes")
    model = TinyLM()
    with pytest.raises(ValueError, match="DMUON_DOORBELL='yes'"):
        DMuon(model, lr=0.02, server=daemon.address,
              routing_options=RoutingOptions(adamw=[model.head]))


def test_overlap_forward_is_bit_identical(daemon):
    torch.manual_seed(1)
    m1 = TinyLM()
    m2 = copy.deepcopy(m1)
    o1 = DMuon(m1, lr=0.02, server=daemon.address, adamw=[m1.head])
    o2 = DMuon(m2, lr=0.02, server=daemon.address, adamw=[m2.head],
               overlap_forward=True)
    train(m1, o1, 8, lm_batch)
    train(m2, o2, 8, lm_batch)
    o2.synchronize()
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), n
    o1.close()
    o2.close()

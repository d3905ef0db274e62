"""DMuon's state <-> torch.optim.Muon + AdamW's (dmuon.to_torch_state_dicts,
DMuon.load_torch_state_dicts), each way equal to an uninterrupted run of
torch's optimizers (fp32 Newton–Schulz); load_state_dict of a bad dict
changes nothing."""

import copy

import pytest
import torch

import dmuon
from dmuon.optim import DMuon
from helpers import MLP, loss_of, mlp_batch
from torch_ref import DM_ADAMW, MUON, ADAMW, assert_same, fp32_muon, pair

pytestmark = pytest.mark.timeout(60)


def _torch_pair(monkeypatch, model):
    mats = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() != 2]
    fp32_muon(monkeypatch)
    return torch.optim.Muon(mats, **MUON), torch.optim.AdamW(others, **ADAMW)


def _torch_step(model, muon, adamw, step):
    loss_of(model, mlp_batch(step)).backward()
    muon.step(), adamw.step(), muon.zero_grad(), adamw.zero_grad()


def _dm_step(model, opt, step):
    loss_of(model, mlp_batch(step)).backward()
    opt.step()
    opt.zero_grad()


def test_dmuon_then_torch(monkeypatch, daemon):
    ref, dm = pair(MLP, seed=11)
    muon, adamw = _torch_pair(monkeypatch, ref)
    opt = DMuon(dm, **MUON, **DM_ADAMW, server=daemon.address)
    for step in range(3):
        _torch_step(ref, muon, adamw, step)
        _dm_step(dm, opt, step)
        assert_same(ref, dm, step)
    m2, a2 = dmuon.to_torch(opt)  # torch's optimizers over the same parameters
    assert isinstance(m2, torch.optim.Muon) and isinstance(a2, torch.optim.AdamW)
    muon_sd, adamw_sd = opt.to_torch_state_dicts()
    assert sorted(muon_sd["state"]) == [0, 1, 2] and sorted(adamw_sd["state"]) == [0, 1, 2]
    opt.close()
    for step in range(3, 6):
        _torch_step(ref, muon, adamw, step)
        _torch_step(dm, m2, a2, step)
        assert_same(ref, dm, step)
    for p, q in zip(muon.param_groups[0]["params"], m2.param_groups[0]["params"]):
        assert torch.allclose(muon.state[p]["momentum_buffer"],
                              m2.state[q]["momentum_buffer"], rtol=1e-5, atol=1e-7)


def test_torch_then_dmuon_in_another_parameter_order(monkeypatch, daemon):
    ref, tm = pair(MLP, seed=12)
    muon, adamw = _torch_pair(monkeypatch, ref)
    # the trainer's own optimizers list the matrices last-layer first
    mats = [tm.fc3.weight, tm.fc2.weight, tm.fc1.weight]
    others = [tm.fc1.bias, tm.fc2.bias, tm.fc3.bias]
    m2, a2 = torch.optim.Muon(mats, **MUON), torch.optim.AdamW(others, **ADAMW)
    for step in range(3):
        _torch_step(ref, muon, adamw, step)
        _torch_step(tm, m2, a2, step)
        assert_same(ref, tm, step)
    opt = DMuon(tm, **MUON, **DM_ADAMW, server=daemon.address)
    with pytest.raises(ValueError, match="muon_params"):
        opt.load_torch_state_dicts(m2.state_dict(), a2.state_dict(),
                                   muon_params=mats[:2])
    opt.load_torch_state_dicts(m2.state_dict(), a2.state_dict(), muon_params=mats,
                               adamw_params=others)
    assert opt.state_dict()["dmuon"]["completed_steps"] == 3
    for step in range(3, 6):
        _torch_step(ref, muon, adamw, step)
        _dm_step(tm, opt, step)
        assert_same(ref, tm, step)
    opt.close()


def _bad_dicts(sd):
    """(what, a state_dict that must be refused) pairs."""
    out = []
    d = copy.deepcopy(sd)
    d["param_groups"] = d["param_groups"][:1]
    out.append(("group count", d))
    d = copy.deepcopy(sd)
    d["param_groups"][0]["nesterov"] = not d["param_groups"][0]["nesterov"]
    out.append(("fixed hyperparameter", d))
    d = copy.deepcopy(sd)
    d["param_groups"][0]["momentum"] = 1.5  # momentum may change, in [0, 1)
    out.append(("momentum out of range", d))
    d = copy.deepcopy(sd)
    k = [k for k, v in d["state"].items() if "momentum_buffer" in v][-1]
    d["state"][k]["momentum_buffer"] = torch.zeros(3, 3)
    out.append(("momentum shape", d))
    d = copy.deepcopy(sd)
    del d["state"][k]["momentum_buffer"]
    out.append(("missing momentum", d))
    d = copy.deepcopy(sd)
    d["state"][k]["momentum_buffer"] = [1.0]
    out.append(("momentum not a tensor", d))
    d = copy.deepcopy(sd)
    d["dmuon"]["format"] = 7
    out.append(("format", d))
    d = copy.deepcopy(sd)
    d["param_groups"][1]["params"] = d["param_groups"][1]["params"][:1]
    out.append(("group size", d))
    return out


def test_bad_state_dict_changes_nothing(monkeypatch, daemon):
    """Each bad dict raises ValueError; lr changed in it is not applied, the
    momentum in dmuond is untouched, training goes on equal to torch's."""
    ref, dm = pair(MLP, seed=13)
    muon, adamw = _torch_pair(monkeypatch, ref)
    opt = DMuon(dm, **MUON, **DM_ADAMW, server=daemon.address)
    for step in range(2):
        _torch_step(ref, muon, adamw, step)
        _dm_step(dm, opt, step)
    good = opt.state_dict()
    for what, bad in _bad_dicts(good):
        bad["param_groups"][0]["lr"] = 123.0  # would show if anything were loaded
        with pytest.raises(ValueError):
            opt.load_state_dict(bad)
        assert opt.param_groups[0]["lr"] == MUON["lr"], what
    for step in range(2, 4):
        _torch_step(ref, muon, adamw, step)
        _dm_step(dm, opt, step)
        assert_same(ref, dm, step)
    opt.close()


def test_state_dict_with_a_dead_daemon_names_local_state_dict(monkeypatch):
    model = MLP()
    opt = DMuon(model, **MUON)  # a private dmuond
    _dm_step(model, opt, 0)
    opt._handoff.link.daemon.process.kill()
    opt._handoff.link.daemon.process.wait()
    with pytest.raises(dmuon.Error, match="local_state_dict"):
        opt.state_dict()
    with pytest.raises(dmuon.Error):
        dmuon.to_torch_state_dicts(opt)
    local = opt.local_state_dict()
    assert "dmuon" not in local and len(local["state"]) == 3  # AdamW's, the biases
    opt.close()

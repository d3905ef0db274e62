"""load_state_dict() checks everything before it changes anything: on an
error the parameter groups, AdamW's state and the daemon's momentum are as
they were, and the message names what to change."""

import copy

import pytest
import torch

from dmuon.optim import DMuon
from helpers import MLP, mlp_batch, state_key, train

pytestmark = pytest.mark.timeout(60)


def _trained(daemon, **kw):
    torch.manual_seed(0)
    model = MLP()
    opt = DMuon(model, server=daemon.address, lr=0.02, **kw)
    train(model, opt, 2, mlp_batch)
    return model, opt


def _snapshot(opt):
    return copy.deepcopy(opt.param_groups), copy.deepcopy(opt.state_dict())


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _refused(opt, sd, match):
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    after = _snapshot(opt)
    assert _same(before[0], after[0]), "param_groups changed by a refused load"
    assert _same(before[1], after[1]), "state (AdamW's or dmuond's) changed by a refused load"


def test_refused_loads_change_nothing_and_name_the_argument(daemon):
    saver_model, saver = _trained(daemon, momentum=0.9, nesterov=False)
    sd = saver.state_dict()
    sd["param_groups"][1]["lr"] = 123.0  # would be loaded if anything were
    _, opt = _trained(daemon)
    _refused(opt, sd, r"param_groups\[0\]\['nesterov'\] is False.*create the DMuon with "
                      r"nesterov=False")
    ok = saver.state_dict()
    bad = copy.deepcopy(ok)
    bad["param_groups"][0]["momentum"] = 1.5  # momentum may differ, in [0, 1)
    _refused(opt, bad, r"param_groups\[0\]\['momentum'\] is 1.5; it must be in \[0, 1\)")
    bad = copy.deepcopy(ok)
    fc2 = state_key(saver, ok, saver_model.fc2.weight)
    del bad["state"][fc2]["momentum_buffer"]
    _, opt2 = _trained(daemon, nesterov=False)  # momentum 0.95: it goes per step
    _refused(opt2, bad,
             r"no momentum for 'fc2.weight'.*check RoutingOptions adamw, muon, experts")
    bad = copy.deepcopy(ok)
    bad["state"][fc2]["momentum_buffer"] = torch.zeros(3, 3)
    _refused(opt2, bad, r"momentum_buffer of 'fc2.weight' is \[3, 3\]; the parameter is "
                        r"\[48, 48\]")
    bad = copy.deepcopy(ok)
    bad["dmuon"]["completed_steps"] = "two"
    _refused(opt2, bad, r"completed step count 'two'")
    bad = copy.deepcopy(ok)
    bad["param_groups"] = bad["param_groups"][:1]
    _refused(opt2, bad,
             r"1 parameter groups, this optimizer 2.*RoutingOptions \(model, adamw, muon\)")
    bad = copy.deepcopy(ok)
    bad["param_groups"][0]["use_muon"] = False
    _refused(opt2, bad, r"param_groups\[0\] is an AdamW group in the checkpoint")
    bad = copy.deepcopy(ok)
    bad["param_groups"][0]["ns_steps"] = 3
    _refused(opt2, bad, r"create the DMuon with ns_steps=3")
    # What passes the checks loads whole: dmuond's momentum and the groups
    # (momentum 0.9 included: sent with each step's hand-offs from now on).
    opt2.load_state_dict(ok)
    assert _same(opt2.state_dict(), ok)
    assert opt2.param_groups[0]["momentum"] == 0.9
    for o in (saver, opt, opt2):
        o.close()


def test_local_state_dict_loads_with_a_warning(daemon):
    model, opt = _trained(daemon)
    local = opt.local_state_dict()
    assert "dmuon" not in local
    torch.manual_seed(0)
    fresh = DMuon(MLP(), server=daemon.address, lr=0.02)
    with pytest.warns(RuntimeWarning, match="Muon momentum starts from zero"):
        fresh.load_state_dict(local)
    assert _same(fresh.local_state_dict()["state"], local["state"])
    opt.close()
    fresh.close()

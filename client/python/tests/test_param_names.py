"""Parameter names, as torch keeps them: an optimizer given (name, parameter)
pairs (named_parameters()) keeps each group's names as its "param_names"
(torch.optim.Optimizer, torch >= 2.6), in param_groups and in
state_dict()["param_groups"]. DMuon's Muon groups must have what
torch.optim.Muon over the same pairs has, and its AdamW groups what
torch.optim.AdamW has: the same parameters and names, and every key torch
has with its value, in torch's order (DMuon adds use_muon and method;
"param_names" comes right after "params", where torch puts it for groups
given no hyperparameters of their own, before those for the others). On
fresh random modules, through add_param_group, load_state_dict and
dmuon.to_torch; without names, neither has "param_names"."""

import pytest
import torch
from torch import nn

import dmuon
from dmuon import DaemonOptions
from dmuon.optim import DMuon

pytest.importorskip("torch.optim._muon", reason="torch.optim.Muon needs torch >= 2.9")


def _random_module(seed):
    """A fresh stack of Linear layers of random widths, the first with a
    bias and the others with or without, some followed by a LayerNorm: 2-D
    weights (Muon, by shape) and 1-D parameters (AdamW)."""
    g = torch.Generator().manual_seed(seed)

    def draw(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    widths = [draw(2, 9) for _ in range(draw(3, 6))]
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers.append(nn.Linear(a, b, bias=not layers or bool(draw(0, 2))))
        if draw(0, 2):
            layers.append(nn.LayerNorm(b))
    return nn.Sequential(*layers)


def _user_groups(model, named, split, prefix=""):
    """The parameters as DMuon and torch are given them: (name, parameter)
    pairs or parameters; with split, two groups, the first with its own lr."""
    ps = [(prefix + n, p) if named else p for n, p in model.named_parameters()]
    if not split:
        return ps
    k = len(ps) // 2
    return [{"params": ps[:k], "lr": 0.05}, {"params": ps[k:]}]


def _by_kind(user_groups, muon_ids, muon):
    """torch.optim.Muon's (muon) or AdamW's groups over the same parameters
    (names included) as DMuon's groups of that kind; a group's lr is Muon's
    (DMuon's AdamW groups take adamw_lr)."""
    groups = user_groups if isinstance(user_groups[0], dict) else [{"params": user_groups}]
    out = []
    for g in groups:
        ps = [x for x in g["params"]
              if (id(x[1] if isinstance(x, tuple) else x) in muon_ids) == muon]
        if ps:
            extra = {k: v for k, v in g.items() if k != "params" and muon}
            out.append({"params": ps, **extra})
    return out


def _torch_pair(user_groups, muon_ids):
    muon = torch.optim.Muon(_by_kind(user_groups, muon_ids, True))
    adamw = torch.optim.AdamW(_by_kind(user_groups, muon_ids, False))
    return muon, adamw


def _assert_like_torch(mine, theirs, what):
    """DMuon's groups of one kind against torch's (param_groups, or
    state_dict()["param_groups"], whose indices differ)."""
    assert len(mine) == len(theirs), what
    for i, (m, t) in enumerate(zip(mine, theirs)):
        order = [k for k in m if k in t and k != "param_names"]
        assert order == [k for k in t if k != "param_names"], (what, i, list(m), list(t))
        for k, v in t.items():
            if k == "params":
                if isinstance(v[0], torch.Tensor):
                    assert [id(p) for p in m[k]] == [id(p) for p in v], (what, i)
            else:
                assert m[k] == v, (what, i, k, m[k], v)


def _assert_optimizer_like_torch(opt, muon, adamw):
    mine_m = [g for g in opt.param_groups if g["use_muon"]]
    mine_a = [g for g in opt.param_groups if not g["use_muon"]]
    _assert_like_torch(mine_m, muon.param_groups, "Muon param_groups")
    _assert_like_torch(mine_a, adamw.param_groups, "AdamW param_groups")
    saved = opt.state_dict()["param_groups"]
    kinds = [g["use_muon"] for g in opt.param_groups]
    _assert_like_torch([s for s, m in zip(saved, kinds) if m],
                       muon.state_dict()["param_groups"], "Muon state_dict")
    _assert_like_torch([s for s, m in zip(saved, kinds) if not m],
                       adamw.state_dict()["param_groups"], "AdamW state_dict")


def _dmuon(user_groups, daemon):
    return DMuon(user_groups, daemon_options=DaemonOptions(daemon.address))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("split", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_param_groups_and_state_dict_as_torch(daemon, seed, split, named):
    model = _random_module(seed)
    groups = _user_groups(model, named, split)
    opt = _dmuon(groups, daemon)
    muon_ids = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    assert muon_ids == {id(p) for p in model.parameters() if p.dim() == 2}
    muon, adamw = _torch_pair(groups, muon_ids)
    _assert_optimizer_like_torch(opt, muon, adamw)
    assert all(("param_names" in g) == named for g in opt.param_groups)
    if not split:  # no group hyperparameters: torch's key order, names included
        for mine, theirs in ((opt.param_groups[0], muon.param_groups[0]),
                             (opt.param_groups[1], adamw.param_groups[0])):
            assert [k for k in mine if k in theirs] == list(theirs)
    if named:
        assert sorted(n for g in opt.param_groups for n in g["param_names"]) == sorted(
            n for n, _ in model.named_parameters())

    # A group added later, with names (or without) as the others.
    extra = _random_module(100 + seed)
    added = _user_groups(extra, named, split=False, prefix="extra.")
    opt.add_param_group({"params": added})
    muon_ids |= {id(p) for p in extra.parameters() if p.dim() == 2}
    for torch_opt, kind in ((muon, True), (adamw, False)):
        for g in _by_kind(added, muon_ids, kind):
            torch_opt.add_param_group(g)
    _assert_optimizer_like_torch(opt, muon, adamw)

    # Names mixed with no names: torch's error, word for word.
    other = nn.Linear(3, 3, bias=False)
    wrong = [("other.weight", other.weight)] if not named else [other.weight]
    with pytest.raises(ValueError) as mine:
        opt.add_param_group({"params": wrong})
    with pytest.raises(ValueError) as theirs:
        muon.add_param_group({"params": wrong})
    assert str(mine.value) == str(theirs.value)
    opt.close()


def test_names_survive_load_state_dict_and_to_torch(daemon):
    model = _random_module(7)
    groups = _user_groups(model, named=True, split=True)
    opt = _dmuon(groups, daemon)
    names = [g["param_names"] for g in opt.param_groups]
    sd = opt.state_dict()
    again = _dmuon(_user_groups(model, named=True, split=True), daemon)
    again.load_state_dict(sd)
    assert [g["param_names"] for g in again.param_groups] == names
    assert [g["param_names"] for g in again.state_dict()["param_groups"]] == names
    muon, adamw = dmuon.to_torch(opt)
    assert [g["param_names"] for g in muon.param_groups] == [
        g["param_names"] for g in opt.param_groups if g["use_muon"]]
    assert [g["param_names"] for g in adamw.param_groups] == [
        g["param_names"] for g in opt.param_groups if not g["use_muon"]]
    assert [g["param_names"] for g in muon.state_dict()["param_groups"]] == [
        g["param_names"] for g in opt.param_groups if g["use_muon"]]
    opt.close()
    again.close()

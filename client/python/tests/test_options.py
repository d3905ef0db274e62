"""DMuon's grouped options: adamw_options=AdamWOptions(...) and
daemon_options=DaemonOptions(...) say what the flat keywords say (the same
training, bit for bit), the flat keywords keep working, and a flat keyword
given with its group's options is a TypeError naming both."""

import pytest
import torch

import dmuon
import dmuon.optim
from dmuon import AdamWOptions, DaemonOptions
from dmuon.optim import DMuon
from helpers import MLP, mlp_batch, train

pytestmark = pytest.mark.timeout(60)


def _adamw_only():
    """Parameters with no Muon matrix: DMuon opens no dmuond session."""
    return [torch.zeros(3, requires_grad=True), torch.zeros(4, requires_grad=True)]


def _adamw_keys(opt):
    """The AdamW groups' hyperparameters (DMuon stores them under AdamW's names)."""
    return [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")}
            for g in opt.param_groups if not g["use_muon"]]


def _trained(**kw):
    torch.manual_seed(0)
    model = MLP()
    opt = DMuon(model, lr=0.02, weight_decay=0.01, **kw)
    losses = train(model, opt, 4, mlp_batch)
    return model, opt, losses


def test_grouped_options_train_exactly_like_the_flat_keywords(daemon):
    flat_model, flat, flat_losses = _trained(
        adamw_lr=3e-3, adamw_betas=(0.9, 0.95), adamw_eps=1e-7, adamw_wd=0.05,
        server=daemon.address, transport="inline", timeout=30.0, job_id="options-flat")
    grouped_model, grouped, grouped_losses = _trained(
        adamw_options=AdamWOptions(lr=3e-3, betas=(0.9, 0.95), eps=1e-7, weight_decay=0.05),
        daemon_options=DaemonOptions(daemon.address, transport="inline", timeout=30.0,
                                     job_id="options-grouped"))
    assert grouped_losses == flat_losses
    for (name, a), b in zip(flat_model.state_dict().items(),
                            grouped_model.state_dict().values()):
        assert torch.equal(a, b), name
    assert _adamw_keys(grouped) == _adamw_keys(flat)
    assert _adamw_keys(flat) == [{"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-7,
                                  "weight_decay": 0.05}]
    assert (flat.job_id, grouped.job_id) == ("options-flat", "options-grouped")
    assert flat.transport == grouped.transport == "inline"
    assert flat.address == grouped.address == daemon.address
    flat.close()
    grouped.close()


def test_defaults_are_torch_adamws():
    opt = DMuon(_adamw_only())
    assert _adamw_keys(opt) == [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                 "weight_decay": 0.01}]
    assert AdamWOptions() == AdamWOptions(1e-3, (0.9, 0.999), 1e-8, 0.01)
    assert DaemonOptions() == DaemonOptions("auto", transport="auto", timeout=60.0,
                                            job_id=None, flags=())


def test_flat_keywords_left_at_none_take_the_groups_defaults():
    opt = DMuon(_adamw_only(), adamw_lr=None, adamw_betas=(0.8, 0.9))
    assert _adamw_keys(opt) == [{"lr": 1e-3, "betas": (0.8, 0.9), "eps": 1e-8,
                                 "weight_decay": 0.01}]


@pytest.mark.parametrize("flat, group", [
    (dict(adamw_lr=3e-3), "adamw_options"),
    (dict(adamw_betas=(0.9, 0.95)), "adamw_options"),
    (dict(adamw_eps=1e-7), "adamw_options"),
    (dict(adamw_wd=0.0), "adamw_options"),
    (dict(server="127.0.0.1:1"), "daemon_options"),
    (dict(transport="inline"), "daemon_options"),
    (dict(timeout=5.0), "daemon_options"),
    (dict(job_id="j"), "daemon_options"),
    (dict(daemon_flags=["--cpu-threads=1"]), "daemon_options"),
], ids=lambda x: next(iter(x)) if isinstance(x, dict) else x)
def test_a_flat_keyword_with_its_group_is_a_type_error_naming_both(flat, group):
    options = {"adamw_options": AdamWOptions(), "daemon_options": DaemonOptions()}[group]
    (keyword,) = flat
    with pytest.raises(TypeError, match=rf"both {keyword}= and {group}="):
        DMuon(_adamw_only(), **flat, **{group: options})


def test_the_other_groups_flat_keywords_mix_with_a_group():
    opt = DMuon(_adamw_only(), adamw_options=AdamWOptions(lr=2e-3), server="auto",
                timeout=5.0)
    assert _adamw_keys(opt)[0]["lr"] == 2e-3


@pytest.mark.parametrize("keyword", ["adamw_options", "daemon_options"])
def test_options_of_another_type_are_a_type_error(keyword):
    with pytest.raises(TypeError, match=rf"{keyword}= must be a dmuon\.\w+Options, not dict"):
        DMuon(_adamw_only(), **{keyword: {"lr": 1e-3}})


def test_options_are_exported_and_frozen():
    assert dmuon.AdamWOptions is dmuon.optim.AdamWOptions is AdamWOptions
    assert dmuon.DaemonOptions is dmuon.optim.DaemonOptions is DaemonOptions
    assert {"AdamWOptions", "DaemonOptions"} <= set(dmuon.__all__)
    with pytest.raises(AttributeError):
        AdamWOptions().lr = 1.0
    with pytest.raises(TypeError):
        DaemonOptions("a:1", "inline")  # all but server are keyword-only

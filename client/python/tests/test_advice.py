"""Routes a user probably did not mean are named at construction
(dmuon/_advice.py): an embedding or head given without its module, which
goes through Newton-Schulz, and a >2-D parameter flattened to one matrix."""

import warnings

import pytest
import torch
from torch import nn

from dmuon import DaemonOptions, RoutingOptions
from dmuon.optim import DMuon


class GPTish(nn.Module):
    def __init__(self, vocab=8192, d=32):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)


def _warned(make):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        opt = make()
    opt.close()
    return [w for w in got if issubclass(w.category, RuntimeWarning)
            and "DMuon" in str(w.message)]


def test_embedding_and_head_without_the_model_are_named(daemon):
    torch.manual_seed(0)
    m = GPTish()
    dd = DaemonOptions(daemon.address)
    # By name: named_parameters() and the usual decay/no-decay groups.
    for params in (list(m.named_parameters()),
                   [{"params": [p for n, p in m.named_parameters() if p.dim() == 2]},
                    {"params": [p for n, p in m.named_parameters() if p.dim() < 2]}]):
        got = _warned(lambda: DMuon(params, lr=0.02, daemon_options=dd))
        if isinstance(params[0], tuple):
            assert len(got) == 1, [str(w.message) for w in got]
            msg = str(got[0].message)
            assert "wte.weight [8192, 32]" in msg and "lm_head.weight [8192, 32]" in msg
            assert "(by its name)" in msg and "fc.weight" not in msg
            assert "RoutingOptions(model=model)" in msg
            assert got[0].filename == __file__  # pointing at the caller
    # By shape: model.parameters().
    got = _warned(lambda: DMuon(m.parameters(), lr=0.02, daemon_options=dd))
    assert len(got) == 1
    msg = str(got[0].message)
    assert "params[0][0] [8192, 32]" in msg and "(by its shape)" in msg
    assert "params[0][2]" not in msg  # fc.weight, 32x32
    # With the model: routed by modules (the embedding to AdamW), no warning.
    assert _warned(lambda: DMuon(m, lr=0.02, daemon_options=dd, routing_options=(
        RoutingOptions(adamw=[m.lm_head])))) == []


def test_a_3d_parameter_flattened_as_one_matrix_is_named(daemon):
    stack = nn.Parameter(torch.randn(4, 16, 8))
    dd = DaemonOptions(daemon.address)
    for make in (lambda: DMuon([stack], lr=0.02, daemon_options=dd),
                 lambda: DMuon([{"params": [stack], "use_muon": True}], lr=0.02,
                               daemon_options=dd)):
        got = _warned(make)
        assert len(got) == 1, [str(w.message) for w in got]
        msg = str(got[0].message)
        assert "[4, 16, 8] as 4x128" in msg and "RoutingOptions(experts=" in msg
    # A conv weight through its module: flattened, no warning.
    conv = nn.Conv1d(4, 6, 3)
    assert _warned(lambda: DMuon(conv, lr=0.02, daemon_options=dd)) == []

"""The Python API's names and annotations: dmuon.optim is the optimizer
module, dmuon.torch its deprecated alias (the same module, so the same
DMuon), and the public API's type hints resolve at run time."""

import importlib
import sys
import typing

import pytest

import dmuon
import dmuon.optim
from dmuon.optim import DMuon


def test_dmuon_torch_is_an_alias_of_dmuon_optim():
    sys.modules.pop("dmuon.torch", None)
    with pytest.warns(DeprecationWarning, match="dmuon.optim"):
        old = importlib.import_module("dmuon.torch")
    assert old is dmuon.optim
    from dmuon.torch import DMuon as OldDMuon
    assert OldDMuon is DMuon


@pytest.mark.parametrize("fn", [
    DMuon.__init__, DMuon.step, DMuon.state_dict, DMuon.load_state_dict,
    DMuon.local_state_dict,
    DMuon.synchronize, DMuon.no_sync, DMuon.close, DMuon.add_param_group,
    DMuon.routing.fget, DMuon.routing_table.fget, DMuon.session.fget,
    DMuon.transport.fget, dmuon.LocalDaemon.__init__, dmuon.find_dmuond,
], ids=lambda f: f.__qualname__)
def test_public_api_is_annotated(fn):
    hints = typing.get_type_hints(fn)
    assert "return" in hints
    code = fn.__code__
    args = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    assert [a for a in args if a != "self" and a not in hints] == []

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
    DMuon.local_state_dict, DMuon.zero_grad, DMuon.to_torch_state_dicts,
    DMuon.load_torch_state_dicts,
    DMuon.synchronize, DMuon.no_sync, DMuon.close, DMuon.add_param_group,
    DMuon.routing.fget, DMuon.routing_table.fget, DMuon.session.fget,
    DMuon.transport.fget, dmuon.LocalDaemon.__init__, dmuon.find_dmuond,
    dmuon.AdamWOptions.__init__, dmuon.DaemonOptions.__init__,
], ids=lambda f: f.__qualname__)
def test_public_api_is_annotated(fn):
    hints = typing.get_type_hints(fn)
    assert "return" in hints
    code = fn.__code__
    args = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    assert [a for a in args if a != "self" and a not in hints] == []


PUBLIC = ["__init__", "step", "state_dict", "load_state_dict", "local_state_dict",
          "zero_grad", "to_torch_state_dicts", "load_torch_state_dicts",
          "synchronize", "no_sync", "close", "add_param_group", "routing",
          "routing_table", "session", "transport"]


def test_public_api_is_defined_on_dmuon_itself():
    """DMuon's machinery lives in objects it owns (dmuon/_handoff.py,
    _recovery.py, _state.py, _table.py), not in mixins; its public methods,
    and their docstrings in help(DMuon), are on DMuon."""
    assert [name for name in PUBLIC if name not in vars(DMuon)] == []
    assert DMuon.__module__ == "dmuon.optim"
    assert [c.__name__ for c in DMuon.__mro__[1:]] == ["Optimizer", "object"]


def test_option_groups_are_keyword_only_and_typed():
    import inspect

    sig = inspect.signature(DMuon)
    hints = typing.get_type_hints(DMuon.__init__)
    for name, cls in [("adamw_options", dmuon.AdamWOptions),
                      ("daemon_options", dmuon.DaemonOptions)]:
        assert sig.parameters[name].kind == inspect.Parameter.KEYWORD_ONLY
        assert sig.parameters[name].default is None
        assert hints[name] == cls | None

"""DMuon's state and checkpoints: opt.state[p]["momentum_buffer"] of a Muon
parameter (read from dmuond when asked for), what load_state_dict() checks
before it changes anything, the Muon hyperparameters dmuond fixes, and
"between steps only" (_at_boundary).

_StateMixin is a part of DMuon (dmuon.optim), split out by concern; it uses
DMuon's attributes: _muon (the Muon routes), _session, _group_of, _opened
(the group specs the session was opened with), _handed, _momentum_cache,
param_groups, state, synchronize().
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from . import _groups


class _MuonState(dict):
    """opt.state[p] of a Muon parameter: "momentum_buffer" is read from
    dmuond when asked for (a copy in the parameter's shape, as
    torch.optim.Muon keeps it; writing to it changes nothing in dmuond: use
    load_state_dict). Never stored, so it never goes into state_dict()'s
    "state" (the momentum is in its "dmuon" entry)."""

    def __init__(self, owner, index, items=()):
        super().__init__(items)
        self._owner, self._index = owner, index

    def __missing__(self, key):
        owner = self._owner()
        if key != "momentum_buffer" or owner is None:
            raise KeyError(key)
        return owner._momentum_buffer(self._index)

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key):
        return key == "momentum_buffer" or super().__contains__(key)

    def __reduce__(self):  # pickles (torch.save of opt.state) as a plain dict
        return (dict, (dict(self),))


class _StateMixin:
    """DMuon's Muon state, checkpoint checks and fixed hyperparameters (see
    the module docstring)."""

    def _install_state(self):
        ref = weakref.ref(self)
        for i, r in enumerate(self._muon):
            st = self.state.get(r.param, {})
            if not isinstance(st, _MuonState) or st._index != i:
                self.state[r.param] = _MuonState(ref, i, dict(st))

    def _momentum_buffer(self, i):
        """Muon matrix i's momentum, fetched from dmuond (once per step)."""
        if self._momentum_cache is None:
            self._at_boundary("state[p]['momentum_buffer'] (a read from dmuond)")
            st = self._session.get_state()
            self._momentum_cache = dict(zip(st["names"], st["momentum"]))
        r = self._muon[i]
        m = torch.from_numpy(self._momentum_cache[self._session.names[i]])
        if r.row_range:
            m = m[r.row_range[0]:r.row_range[1]]
        return m.reshape(r.param.shape).to(device=r.param.device, dtype=r.param.dtype,
                                           copy=True)

    def _at_boundary(self, what):
        self.synchronize()
        if self._session is not None and any(self._handed):
            raise RuntimeError(f"DMuon.{what}() in the middle of a step (gradients are "
                               "already with dmuond): call it after step()")

    def _check_loadable(self, state_dict):
        """Everything load_state_dict() checks, before it changes anything."""
        saved = state_dict.get("param_groups")
        if not isinstance(saved, list) or "state" not in state_dict:
            raise ValueError("DMuon.load_state_dict: not an optimizer state_dict (it "
                             "needs 'state' and 'param_groups')")
        if len(saved) != len(self.param_groups):
            raise ValueError(
                f"DMuon.load_state_dict: the checkpoint has {len(saved)} parameter "
                f"groups, this optimizer {len(self.param_groups)} (each user group is a "
                "Muon and an AdamW group): create the DMuon with the same params/groups, "
                "model, adamw= and muon= as the one that saved it")
        for g, (mine, theirs) in enumerate(zip(self.param_groups, saved)):
            if len(mine["params"]) != len(theirs.get("params", ())):
                raise ValueError(
                    f"DMuon.load_state_dict: param_groups[{g}] has "
                    f"{len(theirs.get('params', ()))} parameters in the checkpoint and "
                    f"{len(mine['params'])} here: the routing differs (check adamw=, "
                    "muon=, the groups, and which parameters exist)")
            if bool(theirs.get("use_muon", mine["use_muon"])) != mine["use_muon"]:
                kind = {True: "a Muon", False: "an AdamW"}
                raise ValueError(
                    f"DMuon.load_state_dict: param_groups[{g}] is "
                    f"{kind[bool(theirs['use_muon'])]} group in the checkpoint and "
                    f"{kind[mine['use_muon']]} group here: the routing differs (check "
                    "adamw=, muon= and the groups' use_muon)")
        if self._session is None:
            return None
        merged = [{**mine, **{k: v for k, v in theirs.items() if k != "params"}}
                  for mine, theirs in zip(self.param_groups, saved)]
        try:
            now = _groups.specs(merged, self._group_of)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"DMuon.load_state_dict: the checkpoint's Muon groups "
                             f"cannot be read ({e!r})") from e
        for g, then, spec in zip(sorted(set(self._group_of)), self._opened, now):
            for key in then:
                if spec[key] != then[key]:
                    name = "ns_coefficients" if key in ("schedule", "coefficients") else key
                    raise ValueError(
                        f"DMuon.load_state_dict: the checkpoint's param_groups[{g}]"
                        f"['{name}'] is {merged[g][name]!r}; this optimizer's dmuond "
                        f"session was opened with {self.param_groups[g][name]!r}, and "
                        f"dmuond fixes it at creation: create the DMuon with "
                        f"{name}={merged[g][name]!r}, then load_state_dict()")
        dm = state_dict.get("dmuon")
        if dm is None:
            return None
        if dm.get("format") != 1 or not isinstance(dm.get("momentum"), Mapping):
            raise ValueError(f"DMuon.load_state_dict: unknown 'dmuon' format "
                             f"{dm.get('format')!r} (this DMuon reads format 1)")
        names, momentum = self._session.names, []
        for r, name in zip(self._muon, names):
            m = dm["momentum"].get(name)
            if m is None:
                raise ValueError(
                    f"DMuon.load_state_dict: no momentum for {name!r} in the checkpoint "
                    f"(it has {sorted(dm['momentum'])}): the model or its routing differs "
                    "(check adamw= and muon=)")
            if tuple(m.shape) != tuple(r.matrix):
                raise ValueError(f"DMuon.load_state_dict: momentum of {name!r} is "
                                 f"{list(m.shape)}; the parameter's matrix is {list(r.matrix)}")
            momentum.append(m.detach().to("cpu", torch.float32).contiguous().numpy())
        return {"completed_steps": int(dm["completed_steps"]), "names": names,
                "momentum": momentum}

    def _check_hyperparameters(self):
        """What the daemon was given must not have changed (lr and weight_decay
        are applied here and may change; equal values in another spelling, e.g.
        a list for a tuple or "original" for None, are fine)."""
        now = _groups.specs(self.param_groups, self._group_of)
        for g, then, spec in zip(sorted(set(self._group_of)), self._opened, now):
            for key in then:
                if spec[key] != then[key]:
                    name = "ns_coefficients" if key in ("schedule", "coefficients") else key
                    raise ValueError(
                        f"DMuon: param_groups[{g}]['{name}'] changed from "
                        f"{then[key]!r} to {spec[key]!r}; dmuond fixes every Muon "
                        "hyperparameter but lr and weight_decay when the optimizer is "
                        "created: create a new DMuon and load_state_dict() into it")

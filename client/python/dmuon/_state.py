"""DMuon's state and checkpoints: opt.state[p] of a Muon parameter (its
"momentum_buffer" and "step" read from dmuond when asked for), state_dict()'s
layout, and what load_state_dict() checks before it changes anything (the
hyperparameters dmuond fixes among them: MuonTable.changed).

state_dict() is torch.optim.Muon + torch.optim.AdamW's layout, whoever asks
(torch.save, torch.distributed.checkpoint: dmuon/_dcp.py):

  - state[k]["momentum_buffer"] of every Muon parameter k: dmuond's fp32
    momentum (exact, float32 whatever the parameter's dtype) in the
    parameter's shape and on its device; a DTensor laid out as the
    parameter when it is one (this rank's rows: DCP reshards it); a
    parameter orthogonalized as parts (experts=, split=) has the full-shape
    tensor of its parts' momentum (momentum is elementwise: it is the
    parameter's momentum). state[k]["step"]: dmuond's completed steps (a
    float32 scalar, as AdamW's).
  - AdamW's state of the other parameters, every AdamW parameter that
    requires grad with AdamW's initial state if it has none yet (step 0,
    zero moments: what AdamW's first step makes, so equivalent to none; it
    is kept in opt.state too, as torch's get_optimizer_state_dict steps a
    fresh optimizer to make it), so that a fresh optimizer's state_dict()
    is a complete destination for dcp.load.
  - "dmuon": {"format": 2, "completed_steps": n} (FORMAT), and for
    parameters row-sharded by shards= (a plain tensor of some of a matrix's
    rows, which torch's layout cannot say) "row_sharded_momentum": {table
    name: the whole fp32 matrix} instead of their momentum_buffer.

load_state_dict() reads that layout; the same without "dmuon" (DCP drops it;
torch.optim.Muon's own state dicts: a Muon parameter without momentum_buffer
starts from zero, the step count is the largest Muon "step", else AdamW's);
and format 1, the layout before 2: "dmuon": {"format": 1,
"completed_steps", "momentum": {table name: fp32 matrix}}.

StateView is that layer for one DMuon: it reads the hand-off
(dmuon/_handoff.py: the session, the MuonTable, the param_groups) and
keeps the momentum read from dmuond for the step it was read in.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import ItemsView, KeysView, Mapping, ValuesView

import torch

from . import _dtensor, _groups, _parts, _routing

FORMAT = 2  # state_dict()["dmuon"]["format"]; load_state_dict() reads 1 and 2
# _loadable_momentum's answer for a checkpoint whose momentum is dmuond's
# mark (checkpoint_momentum="reference", dmuon/_marks.py): nothing to set.
REFERENCE = object()
# What opt.state[p] of a Muon parameter lists and reads from dmuond.
_LAZY = ("momentum_buffer", "step")


class _MuonState(dict):
    """opt.state[p] of a Muon parameter: lists "momentum_buffer" and "step"
    (as torch.optim.Muon's momentum, and the completed steps), whose values
    are read from dmuond only when one is read (once per step: a copy in
    the parameter's shape and dtype; writing to it changes nothing in
    dmuond: use load_state_dict). dict(), copy, pickle (torch.save of
    opt.state) and iteration see them; nothing of them is stored, so
    local_state_dict() never fetches (stored() is what is)."""

    def __init__(self, owner, index, items=()):
        super().__init__(items)
        self._owner, self._index = owner, index  # owner: a weakref to the StateView

    def _lazy(self):
        owner = self._owner()
        if owner is None or owner.session is None:
            return ()
        return tuple(k for k in _LAZY if not dict.__contains__(self, k))

    def stored(self):
        """The items held here (none of dmuond's)."""
        return dict(dict.items(self))

    def __missing__(self, key):
        if key not in self._lazy():
            raise KeyError(key)
        return self._owner().lazy(self._index, key)

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key):
        return dict.__contains__(self, key) or key in self._lazy()

    def __iter__(self):
        yield from list(dict.__iter__(self)) + list(self._lazy())

    def __len__(self):
        return dict.__len__(self) + len(self._lazy())

    def __bool__(self):
        return len(self) > 0

    def keys(self):
        return KeysView(self)

    def items(self):
        return ItemsView(self)

    def values(self):
        return ValuesView(self)

    def __repr__(self):
        items = [f"{k!r}: {v!r}" for k, v in dict.items(self)]
        items += [f"{k!r}: <read from dmuond>" for k in self._lazy()]
        return "{" + ", ".join(items) + "}"

    def __reduce__(self):  # pickles (torch.save of opt.state) as a plain dict
        return (dict, (dict(self.items()),))


def _adamw_initial(p, group):
    """AdamW's state before its first step (torch.optim.Adam._init_group)."""
    from torch.optim.optimizer import _get_scalar_dtype

    fused, capturable = bool(group.get("fused")), bool(group.get("capturable"))
    if fused or capturable:
        step = torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
    else:
        step = torch.tensor(0.0, dtype=_get_scalar_dtype())
    st = {"step": step,
          "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
          "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    if group.get("amsgrad"):
        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def _step_tensor(done):
    return torch.tensor(float(done), dtype=torch.float32)


def _is_row_sharded(r):
    """shards=: a plain tensor of this rank's rows of the matrix."""
    return bool(r.row_range) and getattr(r, "dtensor", None) is None


def _step_taken(st):
    """Whether a parameter's state `st` has a "step" above 0."""
    if st is None or "step" not in st or isinstance(st["step"], Mapping):
        return False
    try:
        return float(st["step"]) > 0
    except (TypeError, ValueError, RuntimeError):
        return False


def local_state_dict(sd):
    """DMuon.local_state_dict() of torch's state_dict `sd`: each Muon
    parameter's state as stored here (nothing read from dmuond: a
    _MuonState's stored()), empty states dropped."""
    sd["state"] = {k: v.stored() if isinstance(v, _MuonState) else dict(v)
                   for k, v in sd["state"].items()}
    sd["state"] = {k: v for k, v in sd["state"].items() if v}
    return sd


class StateView:
    """The Muon half of a DMuon's state (see the module docstring):
    opt.state[p] of its Muon parameters, state_dict()'s Muon entries and
    load_state_dict()'s checks."""

    def __init__(self, handoff, marks):
        self._handoff = handoff
        self.marks = marks  # dmuon/_marks.py: reference checkpoints
        # (session, its step, {table name: momentum}, completed steps): read
        # once per step, for opt.state[p].
        self.cache = None
        self._first_step = True  # check_resumed_adamw runs once

    @property
    def session(self):
        return self._handoff.link.session

    @property
    def _table(self):
        return self._handoff.table

    def forget(self):
        """Drops the momentum read from dmuond (load_state_dict() set another)."""
        self.cache = None

    def daemon_steps(self):
        """The steps dmuond's job has completed (its momentum's), 0 without a
        session."""
        return self.session.step - 1 if self.session is not None else 0

    def check_resumed_adamw(self, state, param_groups):
        """At the first step(): a DMuon that resumed a job dmuond holds momentum
        of (resume="continue" after a restart) continues Muon's half only; if
        AdamW's parameters have no state, the checkpoint's optimizer state was
        not loaded and AdamW would restart from zero while Muon goes on: say
        so, once, with the recipe."""
        first, self._first_step = self._first_step, False
        done = self.daemon_steps()
        if not first or done == 0:
            return
        adamw = [p for g in param_groups if not g["use_muon"] for p in g["params"]
                 if p.requires_grad]
        if adamw and not any(state.get(p) for p in adamw):
            warnings.warn(
                f"DMuon: job '{self._handoff.link.job_id}' continues from dmuond's Muon "
                f"momentum of step {done}, but AdamW's state was not loaded: its "
                f"{len(adamw)} parameters restart from zero moments and step 0, "
                "unlike the run this continues. dmuond keeps only the Muon half: "
                "load your checkpoint's optimizer state (opt.load_state_dict) "
                "before the first step (client/python/README.md, \"Resuming\")",
                RuntimeWarning, stacklevel=4)

    def install(self, state):
        """opt.state[p] of every Muon parameter as a _MuonState (`state`: the
        optimizer's, which torch's load_state_dict() replaces)."""
        ref = weakref.ref(self)
        for i, r in enumerate(self._table.muon):
            st = state.get(r.param, {})
            if not isinstance(st, _MuonState) or st._index != i:
                kept = st.stored() if isinstance(st, _MuonState) else dict(st)
                state[r.param] = _MuonState(
                    ref, i, {k: v for k, v in kept.items() if k not in _LAZY})

    def _fetch(self):
        """({table name: momentum array}, completed steps) from dmuond, once
        per step (for opt.state[p])."""
        session = self.session
        cache = self.cache
        if cache is None or cache[0] is not session or cache[1] != session.step:
            self._handoff.at_boundary("state[p]['momentum_buffer'] (a read from dmuond)")
            session = self.session  # a rollback may have reopened it
            st = session.get_state()
            # Valid while the session and its step are: a step, a reopen or
            # a rollback's reopen make it stale; load_state_dict() drops it.
            cache = self.cache = (session, session.step,
                                 dict(zip(st["names"], st["momentum"])),
                                 int(st["completed_steps"]))
        return cache[2], cache[3]

    def lazy(self, i, key):
        """opt.state[p][key] of Muon table entry i's parameter ("step" or
        "momentum_buffer"), read from dmuond."""
        momentum, done = self._fetch()
        if key == "step":
            return _step_tensor(done)
        return self._momentum_of(i, momentum)

    def _momentum_of(self, i, momentum, dtype=None, copy=True):
        """Table entry i's parameter's momentum as torch.optim.Muon keeps it:
        the parameter's shape, device and dtype (unless `dtype`); a DTensor
        laid out as it; assembled from its parts' (_parts); this rank's rows
        of a shards= matrix. momentum: {table name: array} (GetState's);
        copy=False: the result may share the array's memory."""
        r = self._table.muon[i]
        if isinstance(r, _routing.Part):  # the full shape, from every part's momentum
            full = _parts.momentum_buffer(self._table, self.session.names, i, momentum)
            if r.dtensor is not None:
                return _dtensor.as_param(r, full, dtype=dtype)
            return full.to(device=r.param.device, dtype=dtype or r.param.dtype)
        m = torch.from_numpy(momentum[self.session.names[i]])
        if r.dtensor is not None:  # from the whole matrix, laid out as p (_dtensor)
            return _dtensor.as_param(r, m, dtype=dtype)
        if r.row_range:
            m = m[r.row_range[0]:r.row_range[1]]
        return m.reshape(r.param.shape).to(device=r.param.device,
                                           dtype=dtype or r.param.dtype, copy=copy)

    def init_adamw_state(self, state):
        """AdamW's initial state for every AdamW parameter that requires grad
        and has none (see the module docstring), in `state` (the
        optimizer's)."""
        for group in self._handoff.groups:
            if group["use_muon"]:
                continue
            for p in group["params"]:
                if p.requires_grad and not state.get(p):
                    state[p] = _adamw_initial(p, group)

    def add_muon_state(self, sd, reference=False):
        """Adds dmuond's Muon state to sd (local_state_dict()'s) in torch's
        layout, and the "dmuon" entry (the module docstring). reference:
        each Muon parameter's "step" only, and "momentum_ref" naming the
        job's mark of the step (dmuon/_marks.py), no GetState."""
        if reference:
            momentum, done = None, self.daemon_steps()
        else:
            st = self.session.get_state()
            momentum = dict(zip(st["names"], st["momentum"]))
            done = int(st["completed_steps"])
        key = {id(p): k for g, saved in zip(self._handoff.groups, sd["param_groups"])
               for p, k in zip(g["params"], saved["params"])}
        whole = {}
        for p, idx in self._table.by_param:
            k, r = key[id(p)], self._table.muon[idx[0]]
            entry = {n: v for n, v in sd["state"].get(k, {}).items() if n not in _LAZY}
            if momentum is None:
                pass  # a reference: the momentum stays on dmuond
            elif _is_row_sharded(r):
                whole[r.name] = torch.from_numpy(momentum[self.session.names[idx[0]]])
            else:
                entry["momentum_buffer"] = self._momentum_of(  # a fresh GetState's
                    idx[0], momentum, torch.float32, copy=False)
            entry["step"] = _step_tensor(done)
            sd["state"][k] = entry
        sd["dmuon"] = {"format": FORMAT, "completed_steps": done}
        if reference:
            sd["dmuon"]["momentum_ref"] = {"job_id": self._handoff.link.job_id,
                                           "step": done}
        if whole:
            sd["dmuon"]["row_sharded_momentum"] = whole
        return sd

    def muon_keys(self, saved_groups):
        """The state_dict keys of the Muon parameters (the groups' lengths
        were checked)."""
        return {k for mine, theirs in zip(self._handoff.groups, saved_groups)
                if mine["use_muon"] for k in theirs.get("params", ())}

    def load(self, state_dict):
        """load_state_dict()'s Muon half, everything checked first
        (check_loadable): dmuond's momentum replaced by the state_dict's (a
        RuntimeWarning when it has none: the Muon momentum starts from
        zero). Returns the rest, for torch's load_state_dict: the Muon
        parameters' state without "momentum_buffer" and "step", no "dmuon"."""
        daemon_state = self.check_loadable(state_dict)
        if daemon_state is REFERENCE:
            daemon_state = None  # dmuond's job is at the checkpoint's step
        elif self.session is not None and daemon_state is None:
            self._warn_without_momentum(state_dict)
        if daemon_state is not None:
            self._handoff.load_momentum(daemon_state)  # first: it can still fail
            self.forget()
        muon_keys = self.muon_keys(state_dict["param_groups"])
        state = {k: ({n: x for n, x in v.items() if n not in _LAZY}
                     if k in muon_keys and isinstance(v, Mapping) else v)
                 for k, v in state_dict["state"].items()}
        return {**{k: v for k, v in state_dict.items() if k != "dmuon"}, "state": state}

    def _warn_without_momentum(self, state_dict):
        """load_state_dict of a state_dict without Muon momentum (saved by
        local_state_dict, or by an optimizer without Muon): dmuond's momentum
        is left as it is. That is the resume recipe when dmuond holds the
        job's momentum of the checkpoint's step (resume="continue"); say so
        only when it holds none (Muon starts from zero) or another step's."""
        done = self.daemon_steps()
        saved = {int(float(v["step"])) for v in state_dict["state"].values()
                 if isinstance(v, Mapping) and "step" in v}
        if done == 0:
            warnings.warn("DMuon.load_state_dict: no dmuond momentum in this "
                          "state_dict and none on dmuond: Muon momentum starts from "
                          "zero", RuntimeWarning, stacklevel=4)
        elif saved and saved != {done}:
            warnings.warn(
                f"DMuon.load_state_dict: no dmuond momentum in this state_dict; "
                f"dmuond's, of step {done}, is kept, but the checkpoint's AdamW "
                f"state is of step {sorted(saved)[-1]}: the two halves disagree "
                "(load the checkpoint of step "
                f"{done}, or one saved with state_dict(), which holds the momentum)",
                RuntimeWarning, stacklevel=4)

    def check_loadable(self, state_dict):
        """Everything load_state_dict() checks, before it changes anything."""
        saved = state_dict.get("param_groups")
        if not isinstance(saved, list) or "state" not in state_dict:
            raise ValueError("DMuon.load_state_dict: not an optimizer state_dict (it "
                             "needs 'state' and 'param_groups')")
        if len(saved) != len(self._handoff.groups):
            raise ValueError(
                f"DMuon.load_state_dict: the checkpoint has {len(saved)} parameter "
                f"groups, this optimizer {len(self._handoff.groups)} (each user group is a "
                "Muon and an AdamW group): create the DMuon with the same params/groups "
                "and RoutingOptions (model, adamw, muon) as the one that saved it")
        for g, (mine, theirs) in enumerate(zip(self._handoff.groups, saved)):
            if len(mine["params"]) != len(theirs.get("params", ())):
                raise ValueError(
                    f"DMuon.load_state_dict: param_groups[{g}] has "
                    f"{len(theirs.get('params', ()))} parameters in the checkpoint and "
                    f"{len(mine['params'])} here: the routing differs (check "
                    "RoutingOptions adamw and muon, the groups, and which parameters "
                    "exist)")
            if bool(theirs.get("use_muon", mine["use_muon"])) != mine["use_muon"]:
                kind = {True: "a Muon", False: "an AdamW"}
                raise ValueError(
                    f"DMuon.load_state_dict: param_groups[{g}] is "
                    f"{kind[bool(theirs['use_muon'])]} group in the checkpoint and "
                    f"{kind[mine['use_muon']]} group here: the routing differs (check "
                    "RoutingOptions adamw and muon, and the groups' use_muon)")
        if self.session is None:
            return None
        merged = [{**mine, **{k: v for k, v in theirs.items() if k != "params"}}
                  for mine, theirs in zip(self._handoff.groups, saved)]
        try:
            now = _groups.specs(merged, self._table.group_of)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"DMuon.load_state_dict: the checkpoint's Muon groups "
                             f"cannot be read ({e!r})") from e
        changed = self._table.changed(now)
        if changed is not None:
            g, name, _, _ = changed
            if name is None:
                raise ValueError(f"DMuon.load_state_dict: the checkpoint's param_groups"
                                 f"[{g}]['momentum'] is {merged[g]['momentum']!r}; it "
                                 "must be in [0, 1)")
            raise ValueError(
                f"DMuon.load_state_dict: the checkpoint's param_groups[{g}]"
                f"['{name}'] is {merged[g][name]!r}; this optimizer's dmuond "
                f"session was opened with {self._handoff.groups[g][name]!r}, and "
                f"dmuond fixes it at creation: create the DMuon with "
                f"{name}={merged[g][name]!r}, then load_state_dict()")
        return self._loadable_momentum(state_dict, saved)

    def _loadable_momentum(self, state_dict, saved):
        """dmuond's SetState for the Muon state in state_dict (the module
        docstring's layouts), or None if it has none; raises ValueError
        naming the parameter for anything that does not fit."""
        dm = state_dict.get("dmuon")
        if dm is not None and (not isinstance(dm, Mapping)
                               or dm.get("format") not in (1, FORMAT)):
            what = dm.get("format") if isinstance(dm, Mapping) else type(dm).__name__
            raise ValueError(f"DMuon.load_state_dict: unknown 'dmuon' format {what!r} "
                             f"(this DMuon reads formats 1 and {FORMAT})")
        if dm is not None and dm["format"] == 1:
            return self._format1_momentum(dm)
        state = state_dict["state"]
        if not isinstance(state, Mapping):
            raise ValueError(f"DMuon.load_state_dict: state_dict['state'] is a "
                             f"{type(state).__name__}, not a dict")
        key = {id(p): k for mine, theirs in zip(self._handoff.groups, saved)
               if mine["use_muon"] for p, k in zip(mine["params"], theirs["params"])}
        entries = self._table.by_param
        found = {}
        for p, idx in entries:
            k = key[id(p)]
            st = state.get(k)
            if st is not None and not isinstance(st, Mapping):
                raise ValueError(f"DMuon.load_state_dict: state[{k!r}] (parameter "
                                 f"{_routing.param_name(self._table.muon[idx[0]])!r}) is a "
                                 f"{type(st).__name__}, not a dict")
            mb = (st or {}).get("momentum_buffer")
            if isinstance(mb, Mapping) and not mb:
                mb = None  # DCP's flattened state: {} for a key it does not have
            found[id(p)] = (k, st, mb)
        if self._is_reference(dm, found):
            self.marks.check_reference_load(
                state_dict, [st["step"] for _, st, _ in found.values()
                             if st is not None and "step" in st] or [0])
            return REFERENCE
        torch_layout = dm is None
        if torch_layout and not any(mb is not None or (st and "step" in st)
                                    for _, st, mb in found.values()):
            return None  # local_state_dict()'s: no Muon state (a warning)
        whole = dm.get("row_sharded_momentum", {}) if dm is not None else {}
        if not isinstance(whole, Mapping):
            raise ValueError("DMuon.load_state_dict: state_dict['dmuon']"
                             "['row_sharded_momentum'] is not a dict")
        names, momentum, steps = self.session.names, {}, []
        for p, idx in entries:
            r = self._table.muon[idx[0]]
            name = _routing.param_name(r)
            k, st, mb = found[id(p)]
            if st is not None and "step" in st and not isinstance(st["step"], Mapping):
                steps.append(st["step"])
            if _is_row_sharded(r):
                m = whole.get(r.name)
                if m is None:
                    raise ValueError(
                        f"DMuon.load_state_dict: no momentum for {name!r} (row-sharded "
                        f"by RoutingOptions(shards=), rows {list(r.row_range)} here) in "
                        "the checkpoint: its whole matrix is in DMuon's own state_dict()['dmuon']"
                        "['row_sharded_momentum'], which torch's layout (DCP's) does "
                        "not have. Save and load opt.state_dict() whole, or use DTensor "
                        "parameters")
                momentum[r.name] = self._checked_matrix(r, m, f"momentum of {name!r}")
                continue
            if mb is None:
                if not torch_layout:
                    raise ValueError(
                        f"DMuon.load_state_dict: no momentum for {name!r} in the "
                        f"checkpoint (state[{k!r}] has no 'momentum_buffer'): the model "
                        "or its routing differs (check RoutingOptions adamw, muon, experts "
                        "and split)")
                for i in idx:  # torch's layout: never stepped, zero
                    momentum[names[i]] = torch.zeros(self._table.muon[i].matrix)
                continue
            full = self._checked_buffer(p, r, k, mb)
            for i in idx:
                q = self._table.muon[i]
                part = q.view(full) if isinstance(q, _routing.Part) else full
                momentum[names[i]] = part.reshape(q.matrix)
        try:
            if not torch_layout:
                done = int(dm.get("completed_steps"))
            else:
                if not steps:  # torch.optim.Muon's: AdamW's step count
                    muon_keys = self.muon_keys(saved)
                    steps = [v["step"] for k, v in state.items() if k not in muon_keys
                             and isinstance(v, Mapping) and "step" in v]
                done = int(max([float(s) for s in steps] or [0]))
            if done < 0:
                raise ValueError
        except (TypeError, ValueError, RuntimeError):
            what = dm.get("completed_steps") if not torch_layout else steps
            raise ValueError(f"DMuon.load_state_dict: the completed step count "
                             f"{what!r} is not a count of steps") from None
        if torch_layout and done == 0 and any(bool(m.any()) for m in momentum.values()):
            done = 1  # torch.optim.Muon's state after steps it does not count
        return {"completed_steps": done, "names": names,
                "momentum": [momentum[n].detach().to("cpu", torch.float32)
                             .contiguous().numpy() for n in names]}

    def _is_reference(self, dm, found):
        """Whether the checkpoint's Muon momentum is a reference to dmuond's
        mark: its "dmuon" entry says so (momentum_ref), or, without one (DCP
        drops it), no Muon parameter has a momentum_buffer but some have a
        "step" of a step taken: whatever this optimizer's
        checkpoint_momentum, such a checkpoint is a reference one (torch's
        Muon keeps a momentum_buffer once a parameter stepped), and loading
        it as never stepped would write zeros over dmuond's momentum."""
        if isinstance(dm, Mapping) and "momentum_ref" in dm:
            return True
        if dm is not None:
            return False
        if self.marks.mode != "reference" and any(
                _is_row_sharded(self._table.muon[idx[0]]) for _, idx in self._table.by_param):
            return False  # their momentum is in the missing "dmuon" entry: an error
        return (not any(mb is not None for _, _, mb in found.values())
                and any(_step_taken(st) for _, st, _ in found.values()))

    def _checked_buffer(self, p, r, k, mb):
        """A loaded momentum_buffer as a CPU fp32 tensor in p's shape."""
        name = _routing.param_name(r)
        if _dtensor.is_dtensor(mb):
            mb = mb.full_tensor()  # a collective: every rank loads, in table order
        if not isinstance(mb, torch.Tensor):
            raise ValueError(f"DMuon.load_state_dict: state[{k!r}]['momentum_buffer'] "
                             f"of {name!r} is a {type(mb).__name__}, not a tensor")
        shape = tuple(mb.shape)
        if shape != tuple(p.shape) and not (len(shape) == 2 and shape == tuple(r.matrix)
                                            and not isinstance(r, _routing.Part)):
            raise ValueError(f"DMuon.load_state_dict: momentum_buffer of {name!r} is "
                             f"{list(shape)}; the parameter is {list(p.shape)}")
        return mb.detach().to("cpu", torch.float32).reshape(p.shape)

    def _checked_matrix(self, r, m, what):
        if not isinstance(m, torch.Tensor):
            raise ValueError(f"DMuon.load_state_dict: {what} is a {type(m).__name__}, "
                             "not a tensor")
        if tuple(m.shape) != tuple(r.matrix):
            raise ValueError(f"DMuon.load_state_dict: {what} is {list(m.shape)}; the "
                             f"parameter's matrix is {list(r.matrix)}")
        return m

    def _format1_momentum(self, dm):
        """Format 1's "dmuon" entry: {"completed_steps", "momentum": {table
        name: fp32 matrix}}."""
        if not isinstance(dm.get("momentum"), Mapping):
            raise ValueError("DMuon.load_state_dict: the 'dmuon' entry (format 1) has "
                             "no 'momentum' dict")
        names, momentum = self.session.names, []
        for r, name in zip(self._table.muon, names):
            m = dm["momentum"].get(name)
            if m is None:
                raise ValueError(
                    f"DMuon.load_state_dict: no momentum for {name!r} in the checkpoint "
                    f"(it has {sorted(dm['momentum'])}): the model or its routing differs "
                    "(check RoutingOptions adamw, muon, experts and split)")
            m = self._checked_matrix(r, m, f"momentum of {name!r}")
            momentum.append(m.detach().to("cpu", torch.float32).contiguous().numpy())
        return {"completed_steps": int(dm["completed_steps"]), "names": names,
                "momentum": momentum}

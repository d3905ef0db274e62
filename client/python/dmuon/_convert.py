"""DMuon's state <-> torch.optim.Muon + torch.optim.AdamW's, both ways.

    muon_groups, adamw_groups = dmuon.torch_param_groups(opt)
    muon_sd, adamw_sd = dmuon.to_torch_state_dicts(opt)
    muon = torch.optim.Muon(muon_groups); muon.load_state_dict(muon_sd)
    adamw = torch.optim.AdamW(adamw_groups); adamw.load_state_dict(adamw_sd)
    # (or both at once: muon, adamw = dmuon.to_torch(opt))

    opt = DMuon(model, ...)                     # and back
    opt.load_torch_state_dicts(muon.state_dict(), adamw.state_dict(),
                               muon_params=muon_params, adamw_params=adamw_params)

The torch optimizers' parameters are DMuon's, in DMuon's order: its Muon
groups (opt.param_groups with use_muon=True) become torch.optim.Muon's
groups and its AdamW groups torch.optim.AdamW's, one for one. Muon momentum
travels as torch keeps it, state[p]["momentum_buffer"] in the parameter's
shape; AdamW's state is the same object on both sides. DMuon.state_dict()
is in that layout already (both halves in one dict, dmuon/_state.py), so
to_torch_state_dicts splits it by group kind, and from_torch_state_dicts
joins the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import _native

_native.require_torch("dmuon's torch conversions")
import torch  # noqa: E402
from torch import Tensor

from . import _parts, _state

if TYPE_CHECKING:
    from .optim import DMuon

# torch.optim.Muon's group keys (torch 2.9-2.15).
MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps",
             "ns_steps", "adjust_lr_fn")
# DMuon's keys that torch's AdamW does not have.
_NOT_ADAMW = ("params", "use_muon", "momentum", "base_momentum", "max_momentum")

StateDict = dict[str, Any]


def _names(group: dict[str, Any]) -> dict[str, Any]:
    """A group's "param_names" (torch keeps those of (name, parameter)
    pairs; DMuon's groups too), if it has them: torch.optim.Muon's groups
    and state_dict take them as they are."""
    return {"param_names": list(group["param_names"])} if "param_names" in group else {}


def _check_convertible(opt: DMuon) -> None:
    _parts.check_convertible(opt._table.muon)  # experts= / split=: a momentum per part
    for r in opt._table.muon:
        if r.dtensor is not None:  # FSDP2 / TP (_dtensor)
            # torch.optim.Muon (2.15) cannot step an FSDP2 shard itself: its
            # param.add_ of the update fails on an uneven Shard(0) ("in-place
            # operations that require placement changes are not supported").
            raise NotImplementedError(
                f"dmuon: {r.name} is a DTensor; converting DTensor parameters to "
                "torch.optim.Muon is not supported (torch's Muon does not step every "
                "FSDP2 shard); for checkpoints use DCP (get_optimizer_state_dict), "
                "which takes DMuon's state as torch's layout")
        if r.row_range or r.sharding != "replicated":
            raise NotImplementedError(
                f"dmuon: {r.name} is {r.sharding}-sharded; torch.optim.Muon has no "
                "sharded parameters: convert a single-process DMuon")
    for g, group in enumerate(opt.param_groups):
        if group["use_muon"] and isinstance(group["ns_coefficients"], str):
            raise ValueError(
                f"dmuon: param_groups[{g}] uses ns_coefficients="
                f"{group['ns_coefficients']!r}, a dmuond schedule torch.optim.Muon does "
                "not have (it takes one (a, b, c) triple)")


def torch_param_groups(opt: DMuon) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(Muon groups, AdamW groups): torch.optim.Muon(muon_groups) and
    torch.optim.AdamW(adamw_groups) hold DMuon's parameters, in its order,
    with its hyperparameters (what to_torch_state_dicts' dicts load into)."""
    _check_convertible(opt)
    muon, adamw = [], []
    for group in opt.param_groups:
        if group["use_muon"]:
            h = {k: group[k] for k in MUON_KEYS}
            h["ns_coefficients"] = tuple(group["ns_coefficients"])
            muon.append({**h, **_names(group), "params": list(group["params"])})
        else:
            adamw.append({**{k: v for k, v in group.items() if k not in _NOT_ADAMW},
                          "params": list(group["params"])})
    return muon, adamw


def to_torch_state_dicts(opt: DMuon) -> tuple[StateDict, StateDict]:
    """DMuon's state as (torch.optim.Muon's state_dict, torch.optim.AdamW's),
    for optimizers made over torch_param_groups(opt): opt.state_dict() (in
    torch's layout already) split by group kind, renumbered, each Muon
    momentum_buffer in its parameter's dtype, without the "step" torch.optim.
    Muon does not keep. Reads the Muon momentum from dmuond (between steps; a
    dead daemon raises, naming it)."""
    _check_convertible(opt)
    sd = opt.state_dict()
    muon = {"state": {}, "param_groups": []}
    adamw = {"state": {}, "param_groups": []}
    mi = ai = 0
    for group, saved in zip(opt.param_groups, sd["param_groups"]):
        ids = []
        if group["use_muon"]:
            for p, k in zip(group["params"], saved["params"]):
                m = sd["state"][k]["momentum_buffer"]
                muon["state"][mi] = {"momentum_buffer": m.to(device=p.device,
                                                             dtype=p.dtype, copy=True)}
                ids.append(mi)
                mi += 1
            h = {k: saved[k] for k in MUON_KEYS}
            h["ns_coefficients"] = tuple(h["ns_coefficients"])
            muon["param_groups"].append({**h, **_names(saved), "params": ids})
        else:
            for k in saved["params"]:
                if k in sd["state"]:
                    adamw["state"][ai] = sd["state"][k]
                ids.append(ai)
                ai += 1
            adamw["param_groups"].append(
                {**{k: v for k, v in saved.items() if k not in _NOT_ADAMW}, "params": ids})
    return muon, adamw


def to_torch(opt: DMuon) -> tuple[torch.optim.Optimizer, torch.optim.AdamW | None]:
    """(torch.optim.Muon, torch.optim.AdamW or None) over DMuon's parameters
    holding its state: the same training continues in-process."""
    muon_groups, adamw_groups = torch_param_groups(opt)
    muon_sd, adamw_sd = to_torch_state_dicts(opt)
    muon = adamw = None
    if muon_groups:
        muon = torch.optim.Muon(muon_groups)
        muon.load_state_dict(muon_sd)
    if adamw_groups:
        adamw = torch.optim.AdamW(adamw_groups)
        adamw.load_state_dict(adamw_sd)
    return muon, adamw


def _flat(sd: StateDict, what: str, n: int) -> list[tuple[int, dict[str, Any]]]:
    """[(state index, its group)] per parameter of a torch state_dict."""
    if not isinstance(sd, dict) or not isinstance(sd.get("param_groups"), list) \
            or "state" not in sd:
        raise ValueError(f"dmuon: the {what} state_dict is not an optimizer state_dict "
                         "(it needs 'state' and 'param_groups')")
    out = [(k, g) for g in sd["param_groups"] for k in g.get("params", ())]
    if len(out) != n:
        raise ValueError(f"dmuon: the {what} state_dict has {len(out)} parameters, and "
                         f"this DMuon's {what} groups {n}: build the torch optimizers "
                         "over dmuon.torch_param_groups(opt), or pass their parameters "
                         f"({what.lower()}_params=)")
    return out


def from_torch_state_dicts(opt: DMuon, muon_state_dict: StateDict | None,
                           adamw_state_dict: StateDict | None = None, *,
                           muon_params: Sequence[Tensor] | None = None,
                           adamw_params: Sequence[Tensor] | None = None) -> StateDict:
    """The DMuon state_dict equal to torch.optim.Muon's and AdamW's
    (opt.load_state_dict() takes it, checking it all first). muon_params /
    adamw_params: the parameters the torch optimizers held, in their order
    (default: DMuon's order, torch_param_groups(opt)); each DMuon group takes
    the hyperparameters of the torch group its parameters were in."""
    _check_convertible(opt)
    mine_m = [p for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    mine_a = [p for g in opt.param_groups if not g["use_muon"] for p in g["params"]]
    local = opt.local_state_dict()
    new = {"state": {}, "param_groups": []}
    steps, moved, muon_keys = [0], False, []
    tables = {}
    for what, sd, mine, theirs in (("Muon", muon_state_dict, mine_m, muon_params),
                                   ("AdamW", adamw_state_dict, mine_a, adamw_params)):
        if not mine:
            continue
        if sd is None:
            raise ValueError(f"dmuon: this DMuon has {what} parameters and no {what} "
                             "state_dict was given")
        order = list(theirs) if theirs is not None else mine
        flat = _flat(sd, what, len(order))
        where = {id(p): flat[k] for k, p in enumerate(order)}
        missing = [p for p in mine if id(p) not in where]
        if missing:
            raise ValueError(f"dmuon: {len(missing)} of this DMuon's {what} parameters "
                             f"are not among {what.lower()}_params")
        tables[what] = (sd, where)
    name_of = {id(r.param): r for r in opt._table.muon}
    for group, saved in zip(opt.param_groups, local["param_groups"]):
        what = "Muon" if group["use_muon"] else "AdamW"
        sd, where = tables[what]
        theirs = {id(where[id(p)][1]) for p in group["params"]}
        if len(theirs) != 1:
            raise ValueError(f"dmuon: the parameters of one DMuon {what} group are in "
                             f"{len(theirs)} groups of the {what} state_dict: make the "
                             "torch optimizers' groups DMuon's (torch_param_groups)")
        tg = where[id(group["params"][0])][1]
        ng = dict(saved)
        if group["use_muon"]:
            ng.update({k: tg[k] for k in MUON_KEYS if k in tg})
        else:
            ng.update({k: v for k, v in tg.items() if k != "params"})
        new["param_groups"].append(ng)
        for p, k in zip(group["params"], saved["params"]):
            st = sd["state"].get(where[id(p)][0], {})
            if group["use_muon"]:
                r = name_of[id(p)]
                m = st.get("momentum_buffer")
                m = torch.zeros(p.shape) if m is None else m
                if m.numel() != p.numel():
                    raise ValueError(f"dmuon: momentum_buffer of {r.name} has shape "
                                     f"{list(m.shape)}; the parameter is {list(p.shape)}")
                m = m.detach().reshape(p.shape).to("cpu", torch.float32)
                new["state"][k] = {"momentum_buffer": m}
                muon_keys.append(k)
                moved = moved or bool(m.any())
            elif st:
                new["state"][k] = st
                if "step" in st:
                    steps.append(int(float(st["step"])))
    if opt._table.muon:
        done = max(steps)
        if done == 0 and moved:
            done = 1
        for k in muon_keys:
            new["state"][k]["step"] = torch.tensor(float(done), dtype=torch.float32)
        new["dmuon"] = {"format": _state.FORMAT, "completed_steps": done}
    return new


def load_torch_state_dicts(opt: DMuon, muon_state_dict: StateDict | None,
                           adamw_state_dict: StateDict | None = None, *,
                           muon_params: Sequence[Tensor] | None = None,
                           adamw_params: Sequence[Tensor] | None = None) -> None:
    """Loads torch.optim.Muon's and AdamW's state into `opt` (between steps;
    everything is checked before anything changes: see from_torch_state_dicts
    and DMuon.load_state_dict)."""
    opt.load_state_dict(from_torch_state_dicts(
        opt, muon_state_dict, adamw_state_dict, muon_params=muon_params,
        adamw_params=adamw_params))


__all__ = ["torch_param_groups", "to_torch_state_dicts", "to_torch",
           "from_torch_state_dicts", "load_torch_state_dicts"]

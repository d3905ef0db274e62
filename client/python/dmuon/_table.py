"""DMuon's table: where every parameter went, fixed when the optimizer is
made.

    routes = _table.route(groups, named, routing)   # _routing, _dtensor, _parts
    table = MuonTable(routes, entries, group_of, specs)

MuonTable holds every parameter's Route (the routing table), dmuond's
table entries (the Muon matrices in table order; a parameter with parts,
dmuon/_parts.py, has one entry per part), the optimizer group of each
entry, and the parameter table and hyperparameter groups a dmuond session
is opened with. It is immutable: add_param_group makes a grown one
(grown()). A route's hand-off (hook, ddp, step, step (frozen)) is the one
field that still changes after it is made: a frozen parameter's hook is
added when it is unfrozen (dmuon/_wiring.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from . import _dtensor, _groups, _parts, _routing
from ._options import RoutingOptions
from ._routing import Part, Route

Entry = Route | Part


def route(groups: list[dict[str, Any]], named: dict[int, str], module,
          routing: RoutingOptions, shards=None, strict: bool = True) -> list[Route]:
    """Routes the user's groups: by module and routing's adamw/muon and
    `shards` (_routing.resolve), a Muon DTensor laid out by its placements
    (_dtensor), routing's experts and split as parts (_parts; strict: every
    selector must name a parameter, as at construction). A complex Muon
    parameter is torch.optim.Muon's RuntimeError (AdamW takes it)."""
    routes = _routing.resolve(groups, module, routing.adamw, routing.muon, shards, named)
    _dtensor.route_all(routes)  # FSDP2 / TP
    _parts.route(routes, module, routing.experts, routing.split, strict=strict)
    for r in routes:
        if r.route == "muon" and r.param.is_complex():
            raise RuntimeError(
                f"Muon does not support complex parameters: DMuon routed {r.name} "
                f"({r.param.dtype}, {r.reason}) to Muon; route it to AdamW "
                "(routing_options=RoutingOptions(adamw=[...])), which takes complex "
                "parameters as torch.optim.AdamW does")
    return routes


@dataclasses.dataclass(frozen=True)
class MuonTable:
    """Every route, dmuond's table entries and their groups (see the module
    docstring). specs: the hyperparameter groups (_groups.specs) the dmuond
    session is opened with, one per Muon group in group order."""

    routes: tuple[Route, ...]
    muon: tuple[Entry, ...]
    group_of: tuple[int, ...]  # entry -> its group's index in param_groups
    specs: tuple[dict[str, Any], ...]
    # Derived (__post_init__):
    index: Mapping[int, int] = dataclasses.field(init=False)  # id(param) -> entry
    entries: Mapping[int, tuple[int, ...]] = dataclasses.field(init=False)
    parts: Mapping[int, tuple[int, ...]] = dataclasses.field(init=False)
    table: tuple[dict[str, Any], ...] = dataclasses.field(init=False)
    momentum: Mapping[int, float] = dataclasses.field(init=False)

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        put("routes", tuple(self.routes))
        put("muon", tuple(self.muon))
        put("group_of", tuple(self.group_of))
        put("specs", tuple(self.specs))
        # A parameter with parts: its last part (the DDP bucket plan expands
        # it to every part: _parts.bucket_plan).
        put("index", {id(r.param): i for i, r in enumerate(self.muon)})
        put("entries", {k: tuple(v) for k, v in _routing.indices(self.muon).items()})
        parts: dict[int, list[int]] = {}
        for i, r in enumerate(self.muon):
            if isinstance(r, Part):
                parts.setdefault(id(r.route), []).append(i)
        put("parts", {k: tuple(v) for k, v in parts.items()})
        put("table", tuple(_groups.table(self.muon, self.group_of)))
        put("momentum", dict(zip(self.groups, (s["momentum"] for s in self.specs))))

    @property
    def groups(self) -> list[int]:
        """The Muon groups' indices in param_groups, in order."""
        return sorted(set(self.group_of))

    def changed(self, now: list[dict[str, Any]]) -> tuple[int, str | None, Any, Any] | None:
        """The first way hyperparameter groups `now` (_groups.specs of some
        param_groups, in this table's group order) differ from the specs
        dmuond was opened with: (group, None, None, its momentum) for a
        momentum outside [0, 1) (NaN too); (group, name, then, now) for a
        value dmuond fixes (name: the param_groups key, "ns_coefficients"
        for the schedule and coefficients); None if they do not. The
        momentum may change otherwise: it is sent with each step."""
        for g, then, spec in zip(self.groups, self.specs, now):
            if not 0.0 <= spec["momentum"] < 1.0:  # NaN too
                return g, None, None, spec["momentum"]
            for key in then:
                if key != "momentum" and spec[key] != then[key]:
                    name = "ns_coefficients" if key in ("schedule", "coefficients") else key
                    return g, name, then[key], spec[key]
        return None

    def report(self) -> list[dict[str, Any]]:
        """Every route as a dict (DMuon.routing): name, shape, route, reason,
        matrix, sharding (a Muon route's, else None), handoff (or None) and
        layer (a Muon matrix's in dmuond's table, else None)."""
        return [dict(name=r.name, shape=r.shape, route=r.route, reason=r.reason,
                     matrix=r.matrix, sharding=r.sharding if r.route == "muon" else None,
                     handoff=r.handoff or None, layer=r.layer) for r in self.routes]

    @property
    def by_param(self) -> list[tuple[Any, tuple[int, ...]]]:
        """[(parameter, its entries)] in table order."""
        return [(self.muon[idx[0]].param, idx) for idx in self.entries.values()]

    def grown(self, routes: list[Route], muon: list[Entry], group_of: list[int],
              param_groups: list[dict[str, Any]],
              plan: Callable[[list[Entry]], None]) -> MuonTable:
        """This table with more routes and entries (add_param_group): the
        entries' layers numbered again over the whole table, plan(entries)
        run on them (the hand-off plan: dmuon/_wiring.py), and, with new
        entries, the hyperparameter groups of param_groups now (a new
        session's)."""
        routes = self.routes + tuple(routes)
        if not muon:
            return MuonTable(routes, self.muon, self.group_of, self.specs)
        entries = list(self.muon) + list(muon)
        for r, layer in zip(entries, _routing.layer_ids([r.name for r in entries])):
            r.layer = layer
        plan(entries)
        group_of = self.group_of + tuple(group_of)
        return MuonTable(routes, entries, group_of, _groups.specs(param_groups, group_of))

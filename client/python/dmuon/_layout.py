"""DMuon's layout: how the parameters it is given become its param_groups
and dmuond's table, at construction and at each add_param_group.

    layout, groups, named = Layout.of(params, routing, overlap, hyper)
    routes = layout.route(groups, named)              # _table.route
    torch_groups, group_of = layout.split(groups, named, routes)
    table = layout.table(routes, group_of, param_groups, world)
    new = layout.new_group(param_group, param_groups, pg, world)
    table = layout.add(table, new, base, param_groups, world)

Each user group becomes a Muon group and an AdamW group (_groups.split,
empty ones dropped); each Muon route one dmuond table entry, or one per
part (_parts.expand), with its hand-off plan (_wiring.plan: hook, DDP comm
hook or step()). Layout owns what that takes and nothing of a session: the
routing options (with the model they route by, and its DDP wrapper), the
overlap options, the construction's hyperparameters (every new group's
defaults), whether the parameters came with names, and how many user
groups there are.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

from torch import nn

from . import _advice, _dtensor, _groups, _parts, _table, _wiring
from ._options import OverlapOptions, RoutingOptions
from ._routing import Route
from ._table import Entry, MuonTable


def _compiled_autograd() -> bool:
    try:
        import torch._dynamo.compiled_autograd as ca
        import torch._dynamo.config as dynamo_config
    except ImportError:
        return False
    return bool(getattr(dynamo_config, "compiled_autograd", False)
                or getattr(ca, "compiled_autograd_enabled", False))


class NewGroup(NamedTuple):
    """A user group add_param_group adds (Layout.new_group): its routes, its
    Muon and AdamW groups, its table entries and each entry's group (an
    index into torch_groups)."""

    routes: list[Route]
    torch_groups: list[dict[str, Any]]
    muon: list[Entry]
    group_of: list[int]


class Layout:
    """One DMuon's layout (see the module docstring). routing: the routing
    options, with the model and the selectors as lists; ddp: the model when
    it is a DistributedDataParallel, else None; module: the model to route
    by and hook (DDP's module), or None."""

    def __init__(self, routing: RoutingOptions, overlap: OverlapOptions,
                 hyper: dict[str, Any], named: bool, user_groups: int) -> None:
        self.routing, self.overlap, self.hyper = routing, overlap, hyper
        self.named, self.user_groups = named, user_groups
        model = routing.model
        self.ddp = model if isinstance(model, _wiring._DDP) else None
        self.module = self.ddp.module if self.ddp is not None else model

    @classmethod
    def of(cls, params, routing: RoutingOptions, overlap: OverlapOptions,
           hyper: dict[str, Any]) -> tuple[Layout, list[dict[str, Any]], dict[int, str]]:
        """(layout, the user's groups, their names) of a new DMuon: params
        a model is the model to route by (then RoutingOptions.model may only
        name it), overlap checked against it, and the groups checked as
        torch.optim.Optimizer checks them (_groups.user_groups). hyper: the
        construction's hyperparameters (_groups.split's `shared`)."""
        model = routing.model
        if isinstance(params, nn.Module):
            if model is not None and model is not params:
                raise ValueError("DMuon: params is a model and RoutingOptions(model=) names "
                                 "another one")
            model, params = params, list(params.parameters())
        routing = dataclasses.replace(
            routing, model=model, adamw=list(routing.adamw), muon=list(routing.muon),
            experts=_parts.normalize(routing.experts), split=dict(routing.split or {}))
        module = model.module if isinstance(model, _wiring._DDP) else model
        if overlap.forward and module is None:
            raise ValueError("DMuon: OverlapOptions(forward=True) needs the model (pass it "
                             "as params or as RoutingOptions(model=)) to hook its modules' "
                             "forward")
        if overlap.backward and _compiled_autograd():
            raise ValueError(
                "DMuon: compiled autograd is on (torch._dynamo.config.compiled_autograd"
                "=True): it traces backward's hooks into a graph, and DMuon's overlap "
                "hooks hand each gradient to dmuond (I/O) as backward makes it. Pass "
                "overlap_options=OverlapOptions(backward=False) (gradients are handed over "
                "in step(); compiled autograd then works), or turn compiled autograd off")
        groups, named = _groups.user_groups(params)
        return cls(routing, overlap, hyper, bool(named), len(groups)), groups, named

    def route(self, groups: list[dict[str, Any]], named: dict[int, str]) -> list[Route]:
        """The routes of the construction's groups (_table.route, strict), with
        _advice's warnings about routes the user probably did not mean."""
        routes = _table.route(groups, named, self.module, self.routing,
                              self.routing.shards)
        if self.module is None:
            _advice.embeddings_and_heads(routes, named)
        _advice.flattened_stacks(routes)
        return routes

    def split(self, groups: list[dict[str, Any]], named: dict[int, str],
              routes: list[Route]):
        """(Muon and AdamW groups, each Muon route's group): _groups.split
        with the construction's hyperparameters as every group's defaults
        and the user's names (torch's "param_names")."""
        return _groups.split(groups, routes, self.hyper, named)

    def plan(self, entries: list[Entry], world: int) -> None:
        """Each entry's sharding and hand-off (_wiring.plan)."""
        _wiring.plan(entries, self.ddp, world, self.overlap.reduce_in_daemon,
                     self.overlap.backward, self.module)

    def table(self, routes: list[Route], group_of: list[int],
              param_groups: list[dict[str, Any]], world: int) -> MuonTable:
        """A new optimizer's MuonTable (a parameter with parts, dmuon/
        _parts.py, is one entry per part), with its hand-off plan."""
        entries, group_of = _parts.expand([r for r in routes if r.route == "muon"],
                                          group_of)
        self.plan(entries, world)
        return MuonTable(routes, entries, group_of, _groups.specs(param_groups, group_of))

    def new_group(self, param_group: dict[str, Any], param_groups: list[dict[str, Any]],
                  pg, world: int) -> NewGroup:
        """add_param_group's group, routed as at construction (the model,
        RoutingOptions' adamw and muon; no shards; a selector that names
        nothing is not an error) and checked as torch checks it, before
        anything changes: its names (or none) as the other groups', no
        parameter already in a group; new Muon matrices only with one
        process (they reopen the session, which needs every rank at once)."""
        groups, named = _groups.user_groups([param_group])
        _groups.check_names(bool(named), self.named)
        known = {id(p) for g in param_groups for p in g["params"]}
        if any(id(p) in known for p in groups[0]["params"]):
            raise ValueError("some parameters appear in more than one parameter group")
        routes = _table.route(groups, named, self.module, self.routing, strict=False)
        torch_groups, group_of = self.split(groups, named, routes)
        for r in routes:
            r.group = self.user_groups
            if r.name.startswith("params[0]["):
                r.name = f"params[{self.user_groups}][" + r.name[len("params[0]["):]
        muon, group_of = _parts.expand([r for r in routes if r.route == "muon"], group_of)
        if muon and world > 1:
            raise NotImplementedError(
                "DMuon.add_param_group: new Muon matrices reopen the dmuond session, "
                "which needs every rank at once; with torch.distributed, create the "
                "DMuon with every group (or add only AdamW parameters: use_muon=False)")
        if muon:  # one rank (above): DTensor refusals, no collective
            _dtensor.check(routes, pg, world, self.overlap.forward)
        return NewGroup(routes, torch_groups, muon, group_of)

    def add(self, table: MuonTable, new: NewGroup, base: int,
            param_groups: list[dict[str, Any]], world: int) -> MuonTable:
        """Counts the user group `new`, now that its groups are
        param_groups[base:], and returns `table` grown with its routes and
        entries (MuonTable.grown): every entry planned again, those it had
        keeping their hand-off (their hooks are in place)."""
        self.user_groups += 1
        return table.grown(new.routes, new.muon, [base + g for g in new.group_of],
                           param_groups, functools.partial(self._replan, table, world))

    def _replan(self, old: MuonTable, world: int, entries: list[Entry]) -> None:
        kept = [r.handoff for r in old.muon]
        self.plan(entries, world)
        for r, handoff in zip(entries, kept):
            r.handoff = handoff

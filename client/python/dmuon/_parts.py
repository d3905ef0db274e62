"""Structured parameters: one routed parameter, several Muon matrices.

    RoutingOptions(experts=[moe.w1, "moe.w2"])                  # MoE expert stacks
    RoutingOptions(split={"attn.qkv.weight": [512, 128, 128]})  # fused QKV
    DMuon(model, routing_options=RoutingOptions(...))

Both are one mechanism: a routed parameter maps to a list of logical parts,
each a slice along dim 0 of the parameter (and of its gradient) and each its
own dmuond table entry with its own momentum, exactly as if the part were a
separate parameter given to torch.optim.Muon:

- experts=: a 3-D parameter [E, out, in] is E matrices out x in, parts
  "name[e0]" ... "name[e{E-1}]" (same shape: dmuond batches them). Entries
  are parameters, modules or names (exact, or a prefix ending at a dot): a
  module or a prefix designates its 3-D parameters (not conv weights); a
  parameter named exactly (or given as a tensor) must be 3-D.
  experts="auto" designates every 3-D parameter (not a conv weight) whose
  name (any dotted component) or owning module's class name contains
  "expert" (case-insensitive), unless adamw=, a group's use_muon=False or
  an embedding says otherwise. Off unless asked for.
- split=: {parameter or name: n | [rows, ...] | {label: rows, ...}} splits a
  2-D parameter along dim 0 into n equal parts, or parts of those rows
  (labels "0", "1", ... or the given ones: "name[q]"); the rows must add up
  to the parameter's.

A part's gradient is handed to dmuond as a view of .grad (a contiguous slice
along dim 0, no copy) and its update applied into the view of the parameter;
lr scaling (adjust_lr_fn) uses the part's shape, weight decay the group's.
An expert that got no tokens has a zero gradient slice, not None: it is
decayed and updated like any other, as torch does with a stacked parameter
(None-skipping per expert needs the experts as separate parameters).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from . import _routing
from ._routing import Part


def bucket_plan(table, plan):
    """The DDP bucket plan's entries [(index, kind, offset, numel)] with a
    parameter that has parts replaced by one entry per part (its rows of
    the bucket's flat gradient, handed off by itself). table: the
    MuonTable (dmuon/_table.py)."""
    if not table.parts:
        return plan
    out = []
    for i, kind, offset, numel in plan:
        r = None if i is None else table.muon[i]
        if not isinstance(r, Part):
            out.append((i, kind, offset, numel))
            continue
        for j in table.parts[id(r.route)]:
            start, n = table.muon[j].flat_range()
            out.append((j, kind, offset + start, n))
    return out


def expand(muon, group_of):
    """Muon routes -> dmuond table entries (a route with parts: one entry
    per part, in order), with each entry's group."""
    entries, groups = [], []
    for r, g in zip(muon, group_of):
        specs = getattr(r, "parts", None)
        if not specs:
            entries.append(r)
            groups.append(g)
            continue
        for label, index, matrix in specs:
            entries.append(Part(r, label, index, matrix))
            groups.append(g)
    return entries, groups


def momentum_buffer(table, names, i, momentum):
    """The momentum_buffer (opt.state[p], state_dict()) of table entry i's
    parameter when it has parts: the full-shape fp32 CPU tensor assembled
    from every part's momentum (momentum: {table name: array}; names: the
    session's table names); None for a plain entry."""
    r = table.muon[i]
    if not isinstance(r, Part):
        return None
    full = torch.zeros(r.param.shape, dtype=torch.float32)
    for j in table.parts[id(r.route)]:
        dst = table.muon[j].view(full)
        dst.copy_(torch.from_numpy(momentum[names[j]]).reshape(dst.shape))
    return full


def check_convertible(muon):
    """torch.optim.Muon keeps one momentum per parameter: a parameter
    orthogonalized as parts (of the table entries `muon`) has one per part."""
    for r in muon:
        if isinstance(r, Part):
            what = "an expert stack" if isinstance(r.index, int) else "a split weight"
            n = sum(isinstance(q, Part) and q.route is r.route for q in muon)
            raise NotImplementedError(
                f"dmuon: {r.route.name} {list(r.param.shape)} is {what}, "
                f"orthogonalized as {n} matrices with a momentum each; "
                "torch.optim.Muon keeps one momentum per parameter and "
                "orthogonalizes it whole (a 3-D one not at all), so the state does "
                "not convert. opt.state_dict() keeps it (the full-shape "
                "momentum_buffer, split into its parts again by load_state_dict with "
                "the same RoutingOptions experts and split); in torch, give "
                "torch.optim.Muon each part as a parameter of its own")


# ----------------------------------------------------------------- routing
def normalize(experts):
    """experts= as "auto" or a list of selectors."""
    if experts is None:
        return []
    if isinstance(experts, str):
        return experts if experts == "auto" else [experts]
    if isinstance(experts, (torch.Tensor, nn.Module)):
        return [experts]
    return list(experts)


def _stack(r, owners):
    """3-D and not a conv weight (Conv1d's is [out, in, k])."""
    return r.param.dim() == 3 and not any(
        isinstance(m, nn.modules.conv._ConvNd) for m, _ in owners.get(id(r.param), []))


def _auto_expert(r, owners):
    if not _stack(r, owners) or r.kind in ("adamw= (user)", "group use_muon=False",
                                           "embedding"):
        return False
    if any("expert" in part.lower() for part in r.name.split(".")):
        return True
    return any("expert" in type(m).__name__.lower() for m, _ in owners.get(id(r.param), []))


def _select(entries, routes, what, strict, model_names, owners):
    """The routes an experts= list designates: [(route, named exactly)].
    strict: an entry must name a routed parameter or one of the model's
    (model_names: {id: name}; those may come later, by add_param_group)."""
    by_id = {id(r.param): r for r in routes}
    known = set(model_names.values())
    out = []
    for e in entries:
        if isinstance(e, nn.Module):
            hit = [by_id[id(p)] for p in e.parameters() if id(p) in by_id]
            mine = [r for r in hit if _stack(r, owners)]
            if hit and not mine:
                raise ValueError(f"DMuon: RoutingOptions({what}=[{type(e).__name__}]) has "
                                 "no 3-D parameter (an expert stack is [experts, out, "
                                 "in])")
            out.extend((r, False) for r in mine)
        elif isinstance(e, torch.Tensor):
            if id(e) in by_id:
                out.append((by_id[id(e)], True))
            elif strict and id(e) not in model_names:
                raise ValueError(f"DMuon: RoutingOptions({what}=) names a parameter "
                                 f"{list(e.shape)} that is not among the optimizer's "
                                 "parameters")
        elif isinstance(e, str):
            exact = [r for r in routes if r.name == e]
            if exact:
                out.append((exact[0], True))
                continue
            hit = [r for r in routes if r.name.startswith(e + ".")]
            mine = [r for r in hit if _stack(r, owners)]
            if hit and not mine:
                raise ValueError(f"DMuon: RoutingOptions({what}=[{e!r}]) has no 3-D "
                                 "parameter (an expert stack is [experts, out, in])")
            if not hit and strict and not any(n == e or n.startswith(e + ".")
                                              for n in known):
                raise ValueError(
                    f"DMuon: RoutingOptions({what}=[{e!r}]) names no parameter (known: "
                    f"{', '.join(r.name for r in routes) or 'none'})")
            out.extend((r, False) for r in mine)
        else:
            raise TypeError(f"DMuon: RoutingOptions({what}=) entries are parameters, "
                            f"modules or names, got {type(e)}")
    return out


def _split_rows(name, shape, spec):
    """[(label, rows)] of a split= value, checked against the rows."""
    rows = shape[0]
    if isinstance(spec, bool) or not isinstance(spec, (int, Mapping, list, tuple)):
        raise TypeError(f"DMuon: RoutingOptions(split=) of {name}: give n (equal parts), "
                        f"a list of rows or {{label: rows}}, got {spec!r}")
    if isinstance(spec, int):
        if spec < 1 or rows % spec:
            raise ValueError(f"DMuon: RoutingOptions(split=) of {name}: its {rows} rows "
                             f"({list(shape)}) do not split into {spec} equal parts")
        return [(str(k), rows // spec) for k in range(spec)]
    items = ([(str(k), v) for k, v in spec.items()] if isinstance(spec, Mapping)
             else [(str(k), v) for k, v in enumerate(spec)])
    sizes = [v for _, v in items]
    if not items or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                        for v in sizes) or sum(sizes) != rows:
        raise ValueError(f"DMuon: RoutingOptions(split=) of {name}: parts of {sizes} rows "
                         f"(sum {sum(v for v in sizes if isinstance(v, int))}) do not add "
                         f"up to its {rows} rows ({list(shape)})")
    return items


def _to_muon(r, kind):
    if getattr(r, "dtensor", None) is not None or type(r.param).__name__ == "DTensor":
        raise NotImplementedError(f"DMuon: {r.name} is a DTensor; parts ({kind}) of a "
                                  "DTensor are not supported yet")
    if r.sharding == "rows":
        raise NotImplementedError(f"DMuon: {r.name} is row-sharded (RoutingOptions("
                                  f"shards=)) and has parts ({kind}); shard it by parts "
                                  "instead")
    if r.route != "muon":
        r.route, r.kind = "muon", kind
    r.reason = r.kind + ("; frozen at construction" if r.frozen else "")


def route(routes, module, experts=(), split=None, strict=True):
    """Marks the routes experts= and split= name: routed to Muon, with
    r.parts = [(label, index, (rows, cols))]; the table shows them. Run
    after _routing.resolve (strict: the selectors must all hit, as at
    construction; add_param_group passes False)."""
    experts = normalize(experts)
    auto = experts == "auto"
    model_names, owners = _routing.names_by_id(module), _routing.owners(module)
    changed = False
    chosen = {}
    if auto:
        for r in routes:
            if _auto_expert(r, owners):
                chosen[id(r.param)] = (r, "experts (auto)")
    else:
        for r, _ in _select(list(experts), routes, "experts", strict, model_names, owners):
            if r.param.dim() != 3:
                raise ValueError(
                    f"DMuon: RoutingOptions(experts=) names {r.name} "
                    f"{list(r.param.shape)}, which is {r.param.dim()}-D; an expert stack "
                    "is a 3-D [experts, out, in] parameter (experts that are separate "
                    "parameters, e.g. one nn.Linear each, are separate Muon matrices "
                    "already)")
            if r.kind == "adamw= (user)":
                raise ValueError(f"DMuon: {r.name} is in both RoutingOptions adamw and "
                                 "experts")
            chosen[id(r.param)] = (r, "experts= (user)")
    for r, kind in chosen.values():
        e, rows, cols = (int(d) for d in r.param.shape)
        _to_muon(r, kind)
        r.matrix = (rows, cols)
        r.parts = [(f"e{k}", k, (rows, cols)) for k in range(e)]
        r.reason += f"; {e} experts of {rows} x {cols}"
        changed = True
    by_id = {id(r.param): r for r in routes}
    for key, spec in (split or {}).items():
        if isinstance(key, torch.Tensor):
            r = by_id.get(id(key))
            if r is None and strict and id(key) not in model_names:
                raise ValueError(f"DMuon: RoutingOptions(split=) names a parameter "
                                 f"{list(key.shape)} that is not among the optimizer's "
                                 "parameters")
        elif isinstance(key, str):
            r = next((q for q in routes if q.name == key), None)
            if r is None and strict and key not in model_names.values():
                raise ValueError(f"DMuon: RoutingOptions(split=) names unknown parameter "
                                 f"{key!r} (known: "
                                 f"{', '.join(q.name for q in routes) or 'none'})")
        else:
            raise TypeError(f"DMuon: RoutingOptions(split=) keys are parameters or names, "
                            f"got {type(key)}")
        if r is None:
            continue
        if r.param.dim() != 2:
            raise ValueError(f"DMuon: RoutingOptions(split=) names {r.name} "
                             f"{list(r.param.shape)}, which is {r.param.dim()}-D; split "
                             "splits a 2-D weight along dim 0 (an expert stack is "
                             "RoutingOptions(experts=))")
        if id(r.param) in chosen:
            raise ValueError(f"DMuon: {r.name} is in both RoutingOptions experts and split")
        if r.kind == "adamw= (user)":
            raise ValueError(f"DMuon: {r.name} is in both RoutingOptions adamw and split")
        items = _split_rows(r.name, tuple(r.param.shape), spec)
        _to_muon(r, "split= (user)")
        cols = int(r.param.shape[1])
        r.matrix = (int(r.param.shape[0]), cols)
        r.parts, at = [], 0
        for label, n in items:
            r.parts.append((label, slice(at, at + n), (n, cols)))
            at += n
        r.reason += "; split into " + ", ".join(f"[{label}] {n} x {cols}"
                                                for label, n in items)
        changed = True
    if changed:  # layers of the Muon routes, as _routing.resolve numbers them
        muon_routes = [r for r in routes if r.route == "muon"]
        for r, layer in zip(muon_routes, _routing.layer_ids([m.name for m in muon_routes])):
            r.layer = layer
    return routes

"""Which parameter goes where: dmuond (Muon) or the local AdamW.

By module, as the Muon ecosystem routes (first match wins; the reason is
recorded in the routing table):
  1. named in adamw=[...]                  -> AdamW  ("adamw= (user)")
  2. named in muon=[...]                   -> Muon   ("muon= (user)"; must be >= 2-D)
  3. its group says "use_muon": True/False -> as the group says
  4. owned by an nn.Embedding(Bag), tied
     output heads included                 -> AdamW  ("embedding")
  5. the weight of an nn.Linear (or of
     transformers' Conv1D), both dims > 1  -> Muon   ("nn.Linear weight")
  6. the weight of an nn.ConvNd            -> Muon, flattened to out x (in*k*k)
  7. nn.MultiheadAttention's in_proj_weight
     (or q/k/v_proj_weight)                -> Muon   (the packed q, k, v projection)
  8. everything else                       -> AdamW: biases, norms, raw
     nn.Parameters (cls tokens, learned positional tables, 2-D ones included),
     3-D+ tensors that are not conv weights, Linear weights with a dim of 1.
experts= (3-D expert stacks, "auto" detection only when asked) and split=
(fused 2-D weights) are applied after these rules, by _parts.route: such a
parameter goes to Muon as several matrices (one table entry per part).
An untied output head is an nn.Linear, so rule 5 sends it to Muon; route it
with adamw=[model.lm_head] (a tied head shares the embedding's parameter, so
rule 4 keeps it in AdamW).
Without the model (bare parameters or (name, parameter) pairs) the modules
are unknown and parameters are routed by shape: >= 2-D to Muon (flattened),
the rest to AdamW; the table says so.
A parameter frozen (requires_grad=False) at construction is routed like any
other and shown as frozen; if it is unfrozen later it trains on that route
(a Muon parameter without a gradient in a step is left unchanged).
adamw= and muon= entries may be parameters, modules (all their parameters)
or names (exact, or a prefix ending at a dot: "lm_head" covers
"lm_head.weight").

Layers (layer_key, layer_ids): each Muon matrix also gets the layer of the
daemon's table, which the planner spreads over devices so that the matrices
the next forward needs together come back in parallel (see layer_key).

This module is the bottom of DMuon's routing: Route (one parameter's
route), Part (a dmuond table entry that is a slice of a routed parameter)
and their helpers live here; _dtensor (DTensor layouts) and _parts
(experts=, split=) refine routes after resolve() and import this module,
never each other.
"""

import collections
import dataclasses
import math
import sys
from typing import Optional, Tuple

import torch
from torch import nn


@dataclasses.dataclass
class Route:
    name: str
    param: torch.Tensor
    route: str  # "muon" | "adamw"
    reason: str
    group: int  # index of the user's parameter group
    matrix: Optional[Tuple[int, int]] = None  # whole matrix (rows, cols) for Muon
    sharding: str = "replicated"  # replicated | unreduced | rows | blocks
    row_range: Optional[Tuple[int, int]] = None  # rows: this rank's [begin, end)
    handoff: str = ""  # hook | ddp | step
    shape0: Tuple[int, ...] = ()  # the shape at construction
    layer: Optional[int] = None  # Muon: the table's layer id (layer_ids)
    frozen: bool = False  # requires_grad=False at construction
    kind: str = ""  # the short reason, for the compact summary
    # A DTensor Muon matrix's layout: _dtensor.Info (blocks: its runs).
    dtensor: Optional[object] = None

    @property
    def shape(self):
        return tuple(self.param.shape)


class Part:
    """A dmuond table entry that is a slice (index along dim 0) of a routed
    parameter (_parts: experts=, split=): the route's attributes, with its
    own name and matrix. Its hand-off, sharding and layer are its own (each
    table entry goes through DMuon's hand-off states by itself) and are also
    written to the route, which the routing table shows."""

    def __init__(self, route, label, index, matrix):
        self.route, self.label, self.index = route, label, index
        self.name = f"{route.name}[{label}]"
        self.matrix = matrix
        self._handoff, self._sharding = route.handoff, route.sharding
        self._layer = route.layer

    def __getattr__(self, key):  # param, shape0, row_range, frozen, group, ...
        if key.startswith("__") or key == "route":
            raise AttributeError(key)
        return getattr(self.route, key)

    @property
    def handoff(self):
        return self._handoff

    @handoff.setter
    def handoff(self, value):
        self._handoff = self.route.handoff = value

    @property
    def sharding(self):
        return self._sharding

    @sharding.setter
    def sharding(self, value):
        self._sharding = self.route.sharding = value

    @property
    def layer(self):
        return self._layer

    @layer.setter
    def layer(self, value):
        self._layer = self.route.layer = value

    def view(self, t):
        return t[self.index]

    def flat_range(self):
        """(first element, elements) of the part in the parameter's
        row-major flattening (its rows of a DDP bucket's gradient)."""
        row = math.prod(self.route.param.shape[1:])
        if isinstance(self.index, int):
            return self.index * row, row
        return self.index.start * row, (self.index.stop - self.index.start) * row

    @property
    def shape(self):
        return tuple(self.view(self.route.param.detach()).shape)


def grad(r):
    """The gradient table entry r hands over: .grad, or its part's view."""
    g = r.param.grad
    if g is None or not isinstance(r, Part):
        return g
    return r.view(g)


def param(r):
    """What table entry r's update is applied to: the parameter, or its
    part's view (of the detached parameter: same storage and version)."""
    return r.view(r.param.detach()) if isinstance(r, Part) else r.param


def param_name(r):
    return r.route.name if isinstance(r, Part) else r.name


def indices(muon):
    """{id(parameter): [its table entries' indices]}."""
    out = collections.defaultdict(list)
    for i, r in enumerate(muon):
        out[id(r.param)].append(i)
    return out


def is_dtensor(t) -> bool:
    """Whether t is a torch.distributed.tensor.DTensor (_dtensor lays such
    Muon matrices out)."""
    # A DTensor exists only once torch.distributed.tensor was imported: no
    # import here (it costs time, and torch may be built without it).
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def names_by_id(module):
    names = {}
    if module is not None:
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
    return names


_NO_MODEL = "none; pass routing_options=RoutingOptions(model=...)"


def _ids_of(entries, names, what):
    """Parameter ids an adamw=/muon= list designates."""
    ids = set()
    by_name = {}
    for i, n in names.items():
        by_name.setdefault(n, i)
    for e in entries or ():
        if isinstance(e, nn.Module):
            ids.update(id(p) for p in e.parameters())
        elif isinstance(e, torch.Tensor):
            ids.add(id(e))
        elif isinstance(e, str):
            hit = {i for n, i in by_name.items() if n == e or n.startswith(e + ".")}
            if not hit:
                raise ValueError(
                    f"DMuon: RoutingOptions({what}=[{e!r}]) names no parameter of the "
                    f"model (known: {', '.join(sorted(by_name)) or _NO_MODEL})"
                )
            ids.update(hit)
        else:
            raise TypeError(
                f"DMuon: {what}= entries are parameters, modules or names, got {type(e)}"
            )
    return ids


_MHA_MATRICES = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def _is_hf_conv1d(m):
    # transformers.pytorch_utils.Conv1D (GPT-2's projections): a Linear whose
    # weight is stored (in, out).
    return type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers")


def owners(module):
    """{id(param): [(module, attribute name)]} over every module that
    registers the parameter itself (tied parameters have several)."""
    owners = collections.defaultdict(list)
    if module is not None:
        for m in module.modules():
            for attr, p in m._parameters.items():
                if p is not None:
                    owners[id(p)].append((m, attr))
    return owners


def _by_module(p, owners):
    """(route, kind, reason) from the modules that own p."""
    if any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m, _ in owners):
        tied = [type(m).__name__ for m, _ in owners
                if not isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
        why = "embedding" + (f" (tied to a {tied[0]})" if tied else "")
        return "adamw", "embedding", why
    for m, attr in owners:
        cls = type(m).__name__
        if attr == "weight" and (isinstance(m, nn.Linear) or _is_hf_conv1d(m)):
            if p.dim() == 2 and min(p.shape) > 1:
                return "muon", f"{cls} weight", f"{cls} weight"
            return "adamw", f"{cls} weight with a dim of 1", f"{cls} weight {list(p.shape)}"
        if attr == "weight" and isinstance(m, nn.modules.conv._ConvNd):
            rows, cols = _matrix(p)
            if rows > 1 and cols > 1:
                return "muon", f"{cls} weight", f"{cls} weight, flattened to {rows}x{cols}"
        if attr in _MHA_MATRICES and isinstance(m, nn.MultiheadAttention):
            return "muon", f"MultiheadAttention.{attr}", f"MultiheadAttention.{attr}"
    if not owners:
        return "adamw", "not in the model", "not a parameter of the model"
    m, attr = owners[0]
    cls = type(m).__name__
    if attr == "bias":
        return "adamw", "bias", f"{cls} bias"
    if isinstance(m, (nn.modules.normalization.LayerNorm, nn.modules.normalization.GroupNorm,
                      nn.modules.batchnorm._NormBase, nn.modules.normalization.LocalResponseNorm,
                      nn.modules.normalization.RMSNorm)) or "norm" in cls.lower():
        return "adamw", "norm", f"{cls} {attr}"
    if p.dim() < 2:
        return "adamw", f"{p.dim()}-D", f"{p.dim()}-D {cls}.{attr}"
    return "adamw", "raw nn.Parameter", f"{p.dim()}-D nn.Parameter {cls}.{attr}"


def layer_key(name):
    """The layer a parameter belongs to, as a module-name prefix, or None.

    - a name with a purely numeric component: the name up to and including
      the first one, i.e. the repeated block ("blocks.3.attn.qkv.weight" ->
      "blocks.3", "model.layers.17.mlp.experts.2.w1" -> "model.layers.17");
    - otherwise the module enclosing the parameter's own module
      ("encoder.attn.q.weight" -> "encoder.attn"; "fc1.weight" -> "", the
      model itself: a model without repeated blocks is one layer, whose
      spreading costs nothing, since the planner only spreads at the
      makespan it would reach anyway);
    - None for a parameter of the model itself ("scale") or without a name
      ("params[0][1]", no model given): no layer, placed by cost alone.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isascii() and part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-2]) if len(parts) >= 2 else None


def layer_ids(names):
    """Layer ids of these names: layer_key values numbered 0, 1, ... in order
    of first appearance; None where layer_key is None."""
    ids, out = {}, []
    for name in names:
        key = layer_key(name)
        out.append(None if key is None else ids.setdefault(key, len(ids)))
    return out


def _matrix(p):
    return (int(p.shape[0]), int(math.prod(p.shape[1:])))


def resolve(groups, module, adamw=(), muon=(), shards=None, named=None):
    """Routes every parameter of `groups` (torch-style dicts); returns Routes.
    `named`: {id(param): name} for parameters given as (name, param) pairs.
    A Muon DTensor's layout is _dtensor.route_all's, run next."""
    names = names_by_id(module)
    names.update(named or {})
    adamw_ids = _ids_of(adamw, names, "adamw")
    muon_ids = _ids_of(muon, names, "muon")
    both = adamw_ids & muon_ids
    if both:
        clash = [names.get(i, "?") for i in both]
        raise ValueError(f"DMuon: parameters in both RoutingOptions adamw and muon: "
                         f"{clash}")
    owners_of = owners(module)
    shard_of = {}
    for key, layout in (shards or {}).items():
        pid = id(key) if isinstance(key, torch.Tensor) else None
        if pid is None:
            hit = [i for i, n in names.items() if n == key]
            if not hit:
                raise ValueError(f"DMuon: RoutingOptions(shards=) names unknown parameter "
                                 f"{key!r}")
            pid = hit[0]
        shard_of[pid] = layout
    routes, seen = [], set()
    for gi, group in enumerate(groups):
        for pi, p in enumerate(group["params"]):
            if id(p) in seen:
                raise ValueError(
                    f"DMuon: parameter {names.get(id(p), f'params[{gi}][{pi}]')} "
                    "appears in more than one group"
                )
            seen.add(id(p))
            name = names.get(id(p), f"params[{gi}][{pi}]")
            flag = group.get("use_muon")
            if id(p) in adamw_ids:
                route, kind, why = "adamw", "adamw= (user)", "adamw= (user)"
            elif id(p) in muon_ids or flag is True:
                if p.dim() < 2:
                    raise ValueError(
                        f"DMuon: {name} {list(p.shape)} was routed to Muon but is "
                        f"{p.dim()}-D; Muon needs a matrix (or a conv weight)"
                    )
                why = "muon= (user)" if id(p) in muon_ids else "group use_muon=True"
                route, kind = "muon", why
                if p.dim() > 2:
                    why += ", flattened to {}x{}".format(*_matrix(p))
            elif flag is False:
                route, kind, why = "adamw", "group use_muon=False", "group use_muon=False"
            elif module is not None:
                route, kind, why = _by_module(p, owners_of.get(id(p), []))
            elif p.dim() < 2:
                route, kind = "adamw", f"{p.dim()}-D"
                why = f"{p.dim()}-D (no model=: routed by shape, embeddings not detectable)"
            else:
                route, kind = "muon", f"{p.dim()}-D"
                why = f"{p.dim()}-D (no model=: routed by shape, embeddings not detectable)"
                if p.dim() > 2:
                    why = "{}-D, flattened to {}x{} (no model=: routed by shape, embeddings not detectable)".format(
                        p.dim(), *_matrix(p))
            r = Route(name, p, route, why, gi, _matrix(p) if route == "muon" else None,
                      kind=kind)
            if not p.requires_grad:
                r.frozen = True
                r.reason += "; frozen at construction"
            if r.route == "muon" and is_dtensor(p):
                # FSDP2 / TP: laid out by _dtensor.route_all, after resolve()
                if id(p) in shard_of:
                    raise ValueError(f"DMuon: RoutingOptions(shards=) names {name}, a "
                                     "DTensor: its layout is taken from its placements; "
                                     "leave it out of shards")
            elif id(p) in shard_of:
                if r.route != "muon":
                    raise ValueError(f"DMuon: RoutingOptions(shards=) names {name}, which is "
                                     "not Muon's")
                begin, end, total = (int(x) for x in shard_of[id(p)])
                if not (0 <= begin < end <= total) or end - begin != r.matrix[0]:
                    raise ValueError(
                        f"DMuon: shard of {name}: rows [{begin}, {end}) of {total} "
                        f"do not match its local shape {list(p.shape)}"
                    )
                r.sharding, r.row_range = "rows", (begin, end)
                r.matrix = (total, r.matrix[1])
            r.shape0 = tuple(p.shape)
            routes.append(r)
    muon_routes = [r for r in routes if r.route == "muon"]  # the table's order
    for r, layer in zip(muon_routes, layer_ids([m.name for m in muon_routes])):
        r.layer = layer
    return routes


def format_table(routes):
    rows = [("parameter", "shape", "route", "matrix", "sharding", "hand-off", "why")]
    for r in routes:
        rows.append((
            r.name,
            "x".join(str(d) for d in r.shape) or "scalar",
            "dmuond" if r.route == "muon" else r.route,
            f"{r.matrix[0]}x{r.matrix[1]}" if r.matrix else "-",
            r.sharding if r.route == "muon" else "-",
            r.handoff or "-",
            r.reason,
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(_totals(routes))
    return "\n".join(lines)


def _totals(routes):
    n_muon = sum(r.route == "muon" for r in routes)
    n_elems = sum(r.param.numel() for r in routes if r.route == "muon")
    total = sum(r.param.numel() for r in routes) or 1
    return (f"{n_muon} of {len(routes)} parameters ({100.0 * n_elems / total:.1f}% of the "
            "elements) go to dmuond; the rest are updated here by AdamW")


def _count(n):
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def format_summary(routes, param_groups, where):
    """The compact table: one line per optimizer group (Muon and AdamW halves
    of each user group) with its counts by reason, then the totals."""
    index = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
    by_group = collections.defaultdict(list)
    for r in routes:
        by_group[index.get(id(r.param))].append(r)
    lines = ["DMuon routing (verbose=True prints every parameter; opt.routing lists them):"]
    for gi in sorted(by_group, key=lambda g: -1 if g is None else g):
        rs = by_group[gi]
        kinds = collections.Counter(r.kind for r in rs)
        frozen = sum(r.frozen for r in rs)
        route = "dmuond" if rs[0].route == "muon" else "adamw "
        what = ", ".join(f"{k} {n}" for k, n in kinds.most_common())
        extra = f", {frozen} frozen" if frozen else ""
        to = f" -> {where}" if rs[0].route == "muon" and where else ""
        lines.append(f"  group {gi} {route}: {len(rs)} tensors, "
                     f"{_count(sum(r.param.numel() for r in rs))} elements "
                     f"({what}{extra}){to}")
    lines.append("  " + _totals(routes))
    return "\n".join(lines)

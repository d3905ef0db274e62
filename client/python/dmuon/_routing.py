"""Which parameter goes where: dmuond (Muon) or the local AdamW.

Rules, first match wins (the reason is recorded in the routing table):
  1. requires_grad=False at construction    -> "frozen" (kept in an AdamW group,
                                               updated only if it ever gets a grad)
  2. named in adamw=[...]                   -> AdamW  ("adamw= (user)")
  3. named in muon=[...]                    -> Muon   ("muon= (user)"; must be >= 2-D)
  4. its group says "use_muon": True/False  -> as the group says
  5. the weight of an nn.Embedding(Bag)     -> AdamW  ("embedding")
  6. 0-D or 1-D (biases, norms, scalars)    -> AdamW
  7. 2-D                                    -> Muon   ("2-D weight")
  8. 3-D and more (conv weights)            -> Muon, flattened to out x (in*k*k)
The output head is not guessed: mark it with adamw=[model.lm_head] (it is 2-D).
adamw= and muon= entries may be parameters, modules (all their parameters)
or names (exact, or a prefix ending at a dot: "lm_head" covers
"lm_head.weight").

Layers (layer_key, layer_ids): each Muon matrix also gets the layer of the
daemon's table, which the planner spreads over devices so that the matrices
the next forward needs together come back in parallel (see layer_key).
"""

import dataclasses
import math
from typing import Optional, Tuple

import torch
from torch import nn


@dataclasses.dataclass
class Route:
    name: str
    param: torch.Tensor
    route: str  # "muon" | "adamw" | "frozen"
    reason: str
    group: int  # index of the user's parameter group
    matrix: Optional[Tuple[int, int]] = None  # whole matrix (rows, cols) for Muon
    sharding: str = "replicated"  # replicated | unreduced | rows
    row_range: Optional[Tuple[int, int]] = None  # rows: this rank's [begin, end)
    handoff: str = ""  # hook | ddp | step
    shape0: Tuple[int, ...] = ()  # the shape at construction
    layer: Optional[int] = None  # Muon: the table's layer id (layer_ids)

    @property
    def shape(self):
        return tuple(self.param.shape)


def _names_by_id(module):
    names = {}
    if module is not None:
        for name, p in module.named_parameters():
            names.setdefault(id(p), name)
    return names


def _ids_of(entries, names, what):
    """Parameter ids an adamw=/muon= list designates."""
    ids = set()
    by_name = {n: i for i, n in names.items()}
    for e in entries or ():
        if isinstance(e, nn.Module):
            ids.update(id(p) for p in e.parameters())
        elif isinstance(e, torch.Tensor):
            ids.add(id(e))
        elif isinstance(e, str):
            hit = {i for n, i in by_name.items() if n == e or n.startswith(e + ".")}
            if not hit:
                raise ValueError(
                    f"DMuon: {what}=[{e!r}] names no parameter of the model "
                    f"(known: {', '.join(sorted(by_name)) or 'none; pass model='})"
                )
            ids.update(hit)
        else:
            raise TypeError(
                f"DMuon: {what}= entries are parameters, modules or names, got {type(e)}"
            )
    return ids


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
    `named`: {id(param): name} for parameters given as (name, param) pairs."""
    names = _names_by_id(module)
    names.update(named or {})
    adamw_ids = _ids_of(adamw, names, "adamw")
    muon_ids = _ids_of(muon, names, "muon")
    both = adamw_ids & muon_ids
    if both:
        clash = [names.get(i, "?") for i in both]
        raise ValueError(f"DMuon: parameters in both adamw= and muon=: {clash}")
    embed_ids = set()
    if module is not None:
        for m in module.modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                embed_ids.add(id(m.weight))
    shard_of = {}
    for key, layout in (shards or {}).items():
        pid = id(key) if isinstance(key, torch.Tensor) else None
        if pid is None:
            hit = [i for i, n in names.items() if n == key]
            if not hit:
                raise ValueError(f"DMuon: shards= names unknown parameter {key!r}")
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
            if not p.requires_grad:
                r = Route(name, p, "frozen", "requires_grad=False", gi)
            elif id(p) in adamw_ids:
                r = Route(name, p, "adamw", "adamw= (user)", gi)
            elif id(p) in muon_ids or flag is True:
                if p.dim() < 2:
                    raise ValueError(
                        f"DMuon: {name} {list(p.shape)} was routed to Muon but is "
                        f"{p.dim()}-D; Muon needs a matrix (or a conv weight)"
                    )
                why = "muon= (user)" if id(p) in muon_ids else "group use_muon=True"
                r = Route(name, p, "muon", why, gi, _matrix(p))
            elif flag is False:
                r = Route(name, p, "adamw", "group use_muon=False", gi)
            elif id(p) in embed_ids:
                r = Route(name, p, "adamw", "embedding", gi)
            elif p.dim() < 2:
                r = Route(name, p, "adamw", f"{p.dim()}-D (bias/norm/scalar)", gi)
            elif p.dim() == 2:
                r = Route(name, p, "muon", "2-D weight", gi, _matrix(p))
            else:
                rows, cols = _matrix(p)
                r = Route(name, p, "muon", f"{p.dim()}-D, flattened to {rows}x{cols}",
                          gi, (rows, cols))
            if id(p) in shard_of:
                if r.route != "muon":
                    raise ValueError(f"DMuon: shards= names {name}, which is not Muon's")
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
    if module is None and any(r.route == "muon" for r in routes):
        for r in routes:
            if r.route == "muon" and r.reason == "2-D weight":
                r.reason = "2-D weight (no model=: embeddings not detectable)"
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
    n_muon = sum(r.route == "muon" for r in routes)
    n_elems = sum(r.param.numel() for r in routes if r.route == "muon")
    total = sum(r.param.numel() for r in routes) or 1
    lines.append(
        f"{n_muon} of {len(routes)} parameters ({100.0 * n_elems / total:.1f}% of the "
        "elements) go to dmuond; the rest are updated here by AdamW"
    )
    return "\n".join(lines)

"""DTensor parameters (FSDP2's fully_shard, HSDP, tensor parallelism and
their combinations) for DMuon.

A Muon matrix that is a DTensor, of any placements on a device mesh of any
number of dimensions whose ranks are DMuon's process group, is
orthogonalized once, on its global shape, by dmuond, and each rank applies
exactly its local shard of the update, in place, to the parameter's local
tensor (p._local_tensor, under torch.no_grad), so FSDP2's next all-gather
sees it. The layout is fixed at construction (route, then check, which
compares every rank's rows: one all_gather_object over the group), one of:

  - "rows as held": every mesh dimension shards the rows (Shard(0), or
    _StridedShard(dim=0): FSDP2's fully_shard, TP ColwiseParallel's
    weight, FSDP2 x TP's ColwiseParallel weight) and each rank's local
    shard is one contiguous block of rows, the blocks of all ranks tiling
    the matrix with none empty -> the protocol's SHARDING_ROWS with those
    rows (any rank order): each rank sends its local gradient as it is,
    dmuond gathers the rows, computes once and returns each rank its rows,
    which are its local shard of the update. No collective of DMuon's.
  - "rows split among replicas": placements of row shards and Replicate()
    (HSDP's (Replicate(), Shard(0))): the contiguous rows a rank holds are
    held by its replicas too (the ranks that differ from it only on the
    Replicate() dims); each rank sends its part of them (torch's chunking:
    the layout (_StridedShard(0, sf=shards), Shard(0)) for HSDP), a slice of
    its local gradient with no collective, as SHARDING_ROWS, and the update
    rows dmuond returns are all-gathered among the replicas
    (DTensor.from_local(rows, mesh, that layout).redistribute(mesh,
    p.placements)). One collective per matrix and step, on the update.
  - "rows, redistributed": any other placements with at least one Shard
    (TP RowwiseParallel's Shard(1); FSDP2 x TP's (Shard(0), Shard(1)); a
    conv weight sharded on a kernel dim; HSDP where its split leaves a rank
    no rows) -> the gradient is redistributed (DTensor.redistribute,
    DTensor's own collectives on the parameter's mesh) to "every mesh
    dimension Shard(0)",
    where each rank holds one contiguous, possibly uneven block of rows (its
    place in the mesh decides which; SHARDING_ROWS takes ranges in any rank
    order); that block goes as SHARDING_ROWS, and the update rows dmuond
    returns are redistributed back to the parameter's placements
    (DTensor.from_local(rows, mesh, all-Shard(0), shape=, stride=)
    .redistribute(mesh, p.placements)). Costs one redistribution of the
    gradient and one of the update per matrix and step (an all-to-all, or
    all-gathers, over the mesh). A protocol-level general index map (each
    rank sending and receiving exactly the elements of its local shard, for
    any placements) would avoid both (and the split's all-gather); it is a
    later step.
  - "gathered": a matrix where some rank would hold no rows either way
    (fewer rows than ranks; a row range is never empty) -> its gradient is
    gathered (DTensor.full_tensor()), handed over as SHARDING_REPLICATED
    (rank 0's copy is used), every rank gets the whole update and takes its
    local shard of it by slicing (a redistribution from Replicate(), no
    communication).
  - every placement Replicate() -> SHARDING_REPLICATED (rank 0's gradient;
    every rank gets the whole update).

A gradient whose placements differ from the ones it is sent in (Partial:
not reduced yet) is redistributed first (an all-reduce or a
reduce-scatter). The collectives on the gradient (the redistributions and
full_tensor()) run in DMuon's table order, the same on every rank: such
matrices are handed over at step(), never from a backward hook, where ranks
could reach them in different orders (FSDP2 runs post-accumulate-grad
hooks itself, after its reduce-scatter and HSDP's all-reduce; a plain TP
model runs them in autograd's order). Matrices sent "rows as held" or
"split among replicas" need none on the gradient and leave during
backward (overlap=True). The update's collectives run in step()'s apply,
in table order too.

opt.state[p]["momentum_buffer"] of a Muon DTensor is a DTensor laid out as
p (its mesh and placements), sliced from dmuond's whole matrix (as_param:
no communication).

Refused at construction, naming the parameter: a Partial parameter, a mesh
whose ranks are not DMuon's process group (a sub-mesh, e.g. the dp mesh of
an FSDP2 x TP model's non-TP parameters: DMuon cannot tell whether its
replicas over the other mesh dims hold the same gradient; route it to
AdamW), a local shard other than torch's chunking
(DTensor.from_local(shape=...)), shards= for a DTensor, and
overlap_forward=True (FSDP2 all-gathers in its own forward pre-hooks,
before DMuon's would apply the update).

Every other DTensor parameter (AdamW's) is left to torch.optim.AdamW, which
takes DTensors of any placement as they are.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional, Tuple

import torch


@dataclasses.dataclass
class Info:
    """A Muon DTensor's layout on this rank."""

    placements: tuple
    mesh: object
    # This rank's global rows [begin, end) as sent (SHARDING_ROWS), None
    # when the whole matrix is sent.
    rows: Optional[Tuple[int, int]]
    gather: bool = False  # sent whole: a rank would hold no rows
    # The placements the gradient is sent in and the update comes back in
    # when they are not the parameter's; None: sent as held.
    target: Optional[tuple] = None
    # Split among replicas: the sent rows are local rows [a, b) of the
    # gradient (a slice, no collective); None: redistributed to target.
    local_slice: Optional[Tuple[int, int]] = None
    # The candidates check() chooses from, this rank's rows under each:
    # (as held, split among replicas, all-Shard(0)); None where it does
    # not apply; and the split's target placements.
    candidates: tuple = ()
    split_target: Optional[tuple] = None
    held_begin: int = 0  # the first row held here (with its replicas or not)


def is_dtensor(t) -> bool:
    # A DTensor exists only once torch.distributed.tensor was imported: no
    # import here (it costs time, and torch may be built without it).
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def local(t):
    """A DTensor's local tensor (the storage to update in place), else t."""
    return t._local_tensor if is_dtensor(t) else t


def _unsupported(name, p, why):
    return ValueError(
        f"DMuon: parameter {name} is a DTensor with placements {tuple(p.placements)} "
        f"on a {p.device_mesh.ndim}-D mesh of shape {tuple(p.device_mesh.shape)}: "
        f"{why}. DMuon takes Muon DTensors of any Shard/_StridedShard/Replicate "
        "placements on a mesh whose ranks are its process group; route this one to "
        "AdamW (adamw=[...]), which takes any DTensor, or fix the layout")


def _strided_cls():
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # older torch
        return ()
    return _StridedShard


def _shards_rows(pl, ndim):
    """Whether placement pl shards dim 0 (the matrix rows)."""
    from torch.distributed.tensor import Shard

    strided = _strided_cls()
    if not (isinstance(pl, Shard) or (strided and isinstance(pl, strided))):
        return False
    return pl.dim % ndim == 0


def _contiguous_stride(shape):
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= int(n)
    return tuple(reversed(stride))


def _rows_under(p, mesh, placements):
    """This rank's rows [begin, end) of p laid out by `placements` (only how
    they shard dim 0 matters; another dim must not be sharded) when they
    are one contiguous block, else None. Read off DTensor's own layout: the
    row indices 0..rows-1 laid out so (a local slicing, no communication)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not all(isinstance(pl, Replicate) or _shards_rows(pl, p.dim())
               for pl in placements):
        return None  # another dim sharded: a rank holds parts of rows
    rows = int(p.shape[0])
    idx = torch.arange(rows)  # on the CPU whatever p's device (meta too): DTensor moves it
    held = DTensor.from_local(idx, mesh, [Replicate()] * mesh.ndim, run_check=False)
    held = held.redistribute(mesh, placements)._local_tensor.cpu()
    n = int(held.numel())
    begin = int(held[0]) if n else 0
    if n and not torch.equal(held, torch.arange(begin, begin + n)):
        return None  # not contiguous (some _StridedShard layouts)
    return (begin, begin + n)


def _split_target(p, mesh, placements):
    """Placements that split the rows each rank holds among the ranks that
    hold the same ones (the replicas over Replicate() dims: HSDP's
    (Replicate(), Shard(0)) -> (_StridedShard(0, sf=shards), Shard(0))),
    or None when p's placements are not row shards and Replicate()s with
    both present."""
    from torch.distributed.tensor import Replicate, Shard

    strided = _strided_cls()
    ndim = p.dim()
    if not all(isinstance(pl, Replicate) or _shards_rows(pl, ndim) for pl in placements):
        return None
    if all(isinstance(pl, Replicate) for pl in placements) or not any(
            isinstance(pl, Replicate) for pl in placements):
        return None
    target = []
    for i, pl in enumerate(placements):
        if not isinstance(pl, Replicate):
            target.append(pl)
            continue
        later = 1  # the row shards applied before it, right to left
        for j in range(i + 1, len(placements)):
            if not isinstance(placements[j], Replicate):
                later *= mesh.size(j)
        if later == 1:
            target.append(Shard(0))
        elif strided:
            target.append(strided(0, split_factor=later))
        else:
            return None
    return tuple(target)


def route(r, p, in_shards=False):
    """Sets Route r (a Muon matrix that is DTensor p) to its sharding; the
    choice among the row layouts is check()'s (it sees every rank's)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if in_shards:
        raise ValueError(f"DMuon: shards= names {r.name}, a DTensor: its layout is "
                         "taken from its placements; leave it out of shards=")
    mesh, placements = p.device_mesh, tuple(p.placements)
    strided = _strided_cls()
    for pl in placements:
        if not (isinstance(pl, (Shard, Replicate)) or (strided and isinstance(pl, strided))):
            raise _unsupported(r.name, p, f"placement {pl} (a parameter must be "
                               "reduced: Shard, _StridedShard or Replicate)")
    if all(isinstance(pl, Replicate) for pl in placements):
        r.dtensor = Info(placements, mesh, None)
        r.sharding = "replicated"
        r.reason += "; DTensor Replicate()"
        return
    want, _ = compute_local_shape_and_global_offset(p.shape, mesh, placements)
    if tuple(int(n) for n in want) != tuple(p._local_tensor.shape):
        raise _unsupported(r.name, p, f"its local shard is {list(p._local_tensor.shape)} "
                           f"where torch's chunking of its placements gives {list(want)}; "
                           "a shard layout other than torch's is not supported")
    target = (Shard(0),) * mesh.ndim
    both = _rows_under(p, mesh, placements)  # rows held (with replicas or not)
    replicated = any(isinstance(pl, Replicate) for pl in placements)
    held = None if replicated else both
    split, split_target = None, _split_target(p, mesh, placements)
    if both is not None and split_target is not None:
        split = _rows_under(p, mesh, split_target)
        if split is not None and not (both[0] <= split[0] and split[1] <= both[1]):
            split = None  # not a part of the rows held here
    (n, *_), (begin, *_) = compute_local_shape_and_global_offset(p.shape, mesh, target)
    moved = (int(begin), int(begin) + int(n))
    r.dtensor = Info(placements, mesh, held, candidates=(held, split, moved),
                     split_target=split_target,
                     held_begin=both[0] if both is not None else 0)
    if mesh.size() == 1:  # one rank holds every row
        _choose(r, "held" if held is not None else "moved")
    # else check() chooses, from every rank's rows


def _choose(r, kind):
    """Sets r's layout: "held" (rows as held), "split" (the rows held split
    among their replicas), "moved" (rows redistributed to all-Shard(0)) or
    "gather" (sent whole)."""
    info = r.dtensor
    held, split, moved = info.candidates
    pl = ", ".join(str(x) for x in info.placements)
    if kind == "held":
        info.rows, info.target, info.gather = held, None, False
        r.sharding, r.row_range = "rows", held
        r.reason += f"; DTensor ({pl}), rows [{held[0]}, {held[1]}) here"
    elif kind == "split":
        info.rows, info.target, info.gather = split, info.split_target, False
        a = split[0] - info.held_begin
        info.local_slice = (a, a + split[1] - split[0])
        r.sharding, r.row_range = "rows", split
        r.reason += (f"; DTensor ({pl}), the rows held split among their replicas, "
                     f"rows [{split[0]}, {split[1]}) here")
    elif kind == "moved":
        from torch.distributed.tensor import Shard

        info.rows, info.target, info.gather = moved, (Shard(0),) * info.mesh.ndim, False
        r.sharding, r.row_range = "rows", moved
        r.reason += (f"; DTensor ({pl}) redistributed to all-Shard(0), rows "
                     f"[{moved[0]}, {moved[1]}) here")
    else:
        info.rows, info.target, info.gather = None, None, True
        r.sharding, r.row_range = "replicated", None
        r.reason += (f"; DTensor ({pl}), {r.matrix[0]} rows on {info.mesh.size()} "
                     "ranks (a rank would hold none): gathered and sent whole")


def _tiles(ranges, rows):
    """Whether the row ranges (one per rank) are non-empty and tile [0, rows)."""
    if any(x is None or x[1] <= x[0] for x in ranges):
        return False
    at = 0
    for b, e in sorted(ranges):
        if b != at:
            return False
        at = e
    return at == rows


def check(routes, pg, world, overlap_forward):
    """At construction, with DMuon's process group known: every Muon
    DTensor's mesh must be that group, and each one's layout is chosen from
    every rank's rows (one all_gather_object over the group)."""
    dts = [r for r in routes if r.route == "muon" and getattr(r, "dtensor", None)]
    if not dts:
        return
    if overlap_forward:
        raise ValueError(
            f"DMuon: overlap_forward=True with DTensor parameters ({dts[0].name}, ...) "
            "is not supported yet: FSDP2 all-gathers a module's parameters in its "
            "own forward pre-hook, before DMuon's would apply their update. Pass "
            "overlap_forward=False (updates are applied in step())")
    import torch.distributed as dist

    from . import _ddp

    want = list(range(world)) if pg is None else dist.get_process_group_ranks(pg)
    for r in dts:
        ranks = r.dtensor.mesh.mesh.flatten().tolist()
        if sorted(ranks) != sorted(want):
            raise _unsupported(
                r.name, r.param, f"its mesh spans ranks {ranks}, DMuon's process group "
                f"ranks {want} (pass process_group= the mesh's group: "
                "mesh.get_group() of a 1-D mesh)")
    rowed = [r for r in dts if r.dtensor.candidates and r.dtensor.mesh.size() > 1]
    if not rowed:
        return  # route() chose (Replicate(), or one rank holds every row)
    everyone = _ddp.gather([r.dtensor.candidates for r in rowed], pg, world)
    for k, r in enumerate(rowed):
        for c, kind in enumerate(("held", "split", "moved")):  # the cheapest first
            if _tiles([ranks[k][c] for ranks in everyone], r.matrix[0]):
                _choose(r, kind)
                break
        else:
            _choose(r, "gather")


def at_step(r) -> bool:
    """Whether Route r's gradient needs a collective of DMuon's before it is
    handed over (redistributed or gathered): then it is handed over at
    step(), in table order on every rank, never from a backward hook."""
    info = getattr(r, "dtensor", None)
    return info is not None and (info.gather or (info.target is not None
                                                 and info.local_slice is None))


def local_grad(r, grad):
    """The gradient to hand to dmuond for Route r: this rank's rows (as held,
    or redistributed to all-Shard(0)), or the whole gradient of a matrix
    sent whole. A gradient in other placements (Partial) is reduced on the
    way."""
    info = getattr(r, "dtensor", None)
    if info is None or grad is None:
        return grad
    if not is_dtensor(grad):
        raise ValueError(
            f"DMuon: {r.name} is a DTensor but its .grad is a {type(grad).__name__}; "
            "a DTensor parameter's gradient must be a DTensor")
    if info.gather:
        return grad.full_tensor()
    want = info.placements if info.target is None or info.local_slice else info.target
    if tuple(grad.placements) != tuple(want):
        grad = grad.redistribute(grad.device_mesh, want)
    if info.local_slice:
        a, b = info.local_slice
        return grad._local_tensor[a:b]
    return grad._local_tensor


def local_update(r, u):
    """This rank's local shard of the update dmuond returned for Route r
    (u: the rows it was sent, or the whole matrix), in the local tensor's
    shape, on its device."""
    info = getattr(r, "dtensor", None)
    if info is None or (not info.gather and info.target is None):
        return u
    from torch.distributed.tensor import DTensor, Replicate

    p = r.param
    loc = p._local_tensor
    if info.gather:
        whole = u.reshape(p.shape).to(device=loc.device)
        d = DTensor.from_local(whole, info.mesh, [Replicate()] * info.mesh.ndim,
                               run_check=False, shape=p.shape,
                               stride=_contiguous_stride(p.shape))
    else:
        begin, end = info.rows
        rows = u.reshape((end - begin, *p.shape[1:])).to(device=loc.device)
        d = DTensor.from_local(rows, info.mesh, info.target, run_check=False,
                               shape=p.shape, stride=_contiguous_stride(p.shape))
    return d.redistribute(info.mesh, info.placements)._local_tensor.contiguous()


def as_param(r, m, dtype=None):
    """Momentum m (dmuond's whole matrix) as a DTensor laid out as parameter
    r.param, for opt.state[p]["momentum_buffer"] (dtype: the parameter's
    unless given). Sliced here: no communication."""
    from torch.distributed.tensor import DTensor, Replicate

    info = getattr(r, "dtensor", None)
    if info is None:
        return m
    p = r.param
    loc = p._local_tensor
    whole = m.reshape(p.shape).to(device=loc.device, dtype=dtype or p.dtype, copy=True)
    d = DTensor.from_local(whole, info.mesh, [Replicate()] * info.mesh.ndim,
                           run_check=False, shape=p.shape, stride=_contiguous_stride(p.shape))
    mine = d.redistribute(info.mesh, info.placements)._local_tensor
    return DTensor.from_local(mine.contiguous().clone(), info.mesh, info.placements,
                              run_check=False, shape=p.shape, stride=p.stride())

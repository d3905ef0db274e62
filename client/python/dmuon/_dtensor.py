"""DTensor parameters (FSDP2's fully_shard, HSDP, tensor parallelism and
their combinations) for DMuon.

A Muon matrix that is a DTensor, of any Shard/_StridedShard/Replicate
placements on a device mesh of any number of dimensions whose ranks are
DMuon's process group (or on copies of a sub-mesh, below), is
orthogonalized once, on its global shape, by dmuond, and each rank sends
and receives exactly its local shard: the protocol's SHARDING_BLOCKS (minor
3). The matrix is the parameter viewed as [shape[0], prod(shape[1:])]; a
rank's local tensor is the matrix's rows R by its columns C, row-major,
where R and C list global indices in local order (C composes the local
index sets of dims 1..N-1 row-major). route() reads R and C off DTensor's
own layout at construction: for each tensor dim, an index tensor (arange
along that dim; the other dims sized so that every rank keeps at least one
element) laid out by the parameter's placements (DTensor.from_local(idx,
mesh, [Replicate()] * ndim).redistribute(mesh, placements): a local chunk,
no communication), and compresses them to runs [begin, end)
(ParameterSpec.row_runs / col_runs). Any placements go so: FSDP2's
Shard(0), uneven or not, a rank holding no rows (both run lists empty, 0x0
slots); TP's ColwiseParallel Shard(0) and RowwiseParallel Shard(1); FSDP2 x
TP's (_StridedShard(0, sf), Shard(0)) and (Shard(0), Shard(1)); a conv
weight sharded on a kernel dim; HSDP's (Replicate(), Shard(0)), where each
replica sends its shard and dmuond reads every element from the lowest rank
holding it.

Each rank hands over its local gradient as it is (grad._local_tensor) and
applies the update dmuond returns, in the local tensor's shape, in place to
the parameter's local tensor (p._local_tensor, under torch.no_grad), so
FSDP2's next all-gather sees it. No collective of DMuon's, so such matrices
leave from backward hooks (overlap=True; FSDP2 runs post-accumulate-grad
hooks itself, after its reduce-scatter and HSDP's all-reduce; a TP model in
autograd's order, which may differ between ranks: nothing waits on the
others). The one exception is a gradient whose placements differ from the
parameter's (Partial: not reduced yet, e.g. a model data-parallel over a
Replicate() mesh dim without FSDP2): it is redistributed to them first (an
all-reduce or a reduce-scatter, DTensor's own), so the hook leaves it to
step(), which hands such gradients over in table order on every rank
(needs_collective). dmuond checks at OpenSession that every element is
held by some rank.

A DTensor whose every placement is Replicate() is sent as
SHARDING_REPLICATED (rank 0's gradient; every rank gets the whole update),
at step() (its gradient is typically Partial: reduced first, in table order
on every rank).

opt.state[p]["momentum_buffer"] of a Muon DTensor is a DTensor laid out as
p (its mesh and placements), sliced from dmuond's whole matrix (as_param:
no communication).

A Muon DTensor on a sub-mesh (e.g. the dp mesh of an FSDP2 x TP model's
parameters that are not tensor-parallel) is taken when the ranks' meshes
are copies of one sub-mesh that partition DMuon's process group (one copy
per tp coordinate; check() gathers every rank's mesh once, at
construction): dmuond reads each element from the lowest rank holding it
and every copy receives the update, as HSDP's replicas. The copies must
hold the same gradient, as a tensor-parallel model's replicated layers do
(torch.optim.Muon would otherwise let them drift apart).

Refused at construction, naming the parameter, with the same error on every
rank: a Partial parameter, a mesh with ranks outside DMuon's process group,
sub-meshes that are not such copies (a rank outside its own mesh,
overlapping meshes), a local shard other than torch's chunking
(DTensor.from_local(shape=...)), more runs than the protocol takes (4096 per
list, 65536 row runs x column runs), shards= for a DTensor, and
overlap_forward=True (FSDP2 all-gathers in its own forward pre-hooks,
before DMuon's would apply the update).

Every other DTensor parameter (AdamW's) is left to torch.optim.AdamW, which
takes DTensors of any placement as they are.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import List, Optional, Tuple

import torch

from . import _ddp

Runs = List[Tuple[int, int]]

# The protocol's limits on SHARDING_BLOCKS (docs/protocol.md "Sharding").
MAX_RUNS = 4096
MAX_RUN_PRODUCT = 65536


@dataclasses.dataclass
class Info:
    """A Muon DTensor's layout on this rank."""

    placements: tuple
    mesh: object
    # SHARDING_BLOCKS: this rank's global rows and columns of the matrix, as
    # runs [begin, end) in local order (both empty: it holds nothing); None
    # for an all-Replicate() DTensor (SHARDING_REPLICATED).
    row_runs: Optional[Runs] = None
    col_runs: Optional[Runs] = None


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
        "placements on a mesh whose ranks are its process group (or on copies of a "
        "sub-mesh that partition it); route this one to "
        "AdamW (adamw=[...]), which takes any DTensor, or fix the layout")


def _strided_cls():
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # older torch
        return ()
    return _StridedShard


def _contiguous_stride(shape):
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= int(n)
    return tuple(reversed(stride))


def _to_runs(idx) -> Runs:
    """Indices (a 1-D integer tensor, in local order) as runs [begin, end)
    of consecutive ones."""
    idx = idx.to(torch.int64)
    if idx.numel() == 0:
        return []
    breaks = (torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, idx.numel()]
    vals = idx.tolist()
    return [(vals[a], vals[e - 1] + 1) for a, e in zip(starts, ends)]


def _dim_indices(p, mesh, placements):
    """This rank's global indices of each dim of p, in local order: one index
    tensor per dim, laid out by `placements` (a local chunk of a Replicate()
    tensor: no communication). The dims other than the one read are sized
    to the number of shards they are cut into, so every rank keeps at least
    one element of them; None when a rank still would not (then the caller
    refuses the layout)."""
    from torch.distributed.tensor import DTensor, Replicate

    ndim = p.dim()
    cuts = [1] * ndim  # into how many shards the mesh cuts each dim
    for i, pl in enumerate(placements):
        if not isinstance(pl, Replicate):
            cuts[pl.dim % ndim] *= mesh.size(i)
    out = []
    for d in range(ndim):
        shape = list(cuts)
        shape[d] = int(p.shape[d])
        view = [1] * ndim
        view[d] = shape[d]
        # On the CPU whatever p's device (meta too): from_local moves it to
        # the mesh's device type.
        idx = torch.arange(shape[d]).view(view).expand(shape).contiguous()
        held = DTensor.from_local(idx, mesh, [Replicate()] * mesh.ndim, run_check=False)
        loc = held.redistribute(mesh, placements)._local_tensor.cpu()
        if any(int(loc.shape[e]) == 0 for e in range(ndim) if e != d):
            return None
        out.append(loc[tuple(slice(None) if e == d else 0 for e in range(ndim))].clone())
    return out


def _blocks(p, mesh, placements):
    """(row runs, column runs) of this rank's local shard of p's matrix, or a
    string saying why they cannot be read."""
    dims = _dim_indices(p, mesh, placements)
    if dims is None:
        return "a rank would hold none of a dimension it is not cut along"
    local = tuple(int(n) for n in p._local_tensor.shape)
    got = tuple(int(x.numel()) for x in dims)
    if got != local:
        return (f"its local shard is {list(local)} where the index layout of its "
                f"placements gives {list(got)}")
    if any(n == 0 for n in got):
        return [], []  # holds nothing
    cols = torch.zeros((), dtype=torch.int64)
    for d in range(1, p.dim()):  # row-major composition of dims 1..N-1
        cols = (cols.unsqueeze(-1) * int(p.shape[d]) + dims[d].to(torch.int64)).flatten()
    return _to_runs(dims[0]), _to_runs(cols.flatten())


def _describe(runs: Runs, shown: int = 3) -> str:
    text = " ".join(f"[{b}, {e})" for b, e in runs[:shown])
    if len(runs) > shown:
        text += f" ... ({len(runs)} runs)"
    return text


def route(r, p, in_shards=False):
    """Sets Route r (a Muon matrix that is DTensor p) to its sharding: this
    rank's local shard as runs (SHARDING_BLOCKS), or replicated."""
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
        r.dtensor = Info(placements, mesh)
        r.sharding = "replicated"
        r.reason += "; DTensor Replicate()"
        return
    if mesh.get_coordinate() is None:
        # Not in its mesh: it holds nothing; check() refuses the layout, with
        # the same error on every rank.
        r.dtensor = Info(placements, mesh, [], [])
        r.sharding = "blocks"
        r.reason += "; DTensor on a mesh without this rank"
        return
    want, _ = compute_local_shape_and_global_offset(p.shape, mesh, placements)
    if tuple(int(n) for n in want) != tuple(p._local_tensor.shape):
        raise _unsupported(r.name, p, f"its local shard is {list(p._local_tensor.shape)} "
                           f"where torch's chunking of its placements gives {list(want)}; "
                           "a shard layout other than torch's is not supported")
    got = _blocks(p, mesh, placements)
    if isinstance(got, str):
        raise _unsupported(r.name, p, got)
    rows, cols = got
    if (len(rows) > MAX_RUNS or len(cols) > MAX_RUNS
            or len(rows) * len(cols) > MAX_RUN_PRODUCT):
        raise _unsupported(
            r.name, p, f"its local shard is {len(rows)} row runs x {len(cols)} column "
            f"runs of the {r.matrix[0]}x{r.matrix[1]} matrix; the protocol takes at "
            f"most {MAX_RUNS} runs per list and {MAX_RUN_PRODUCT} row runs x column runs")
    r.dtensor = Info(placements, mesh, rows, cols)
    r.sharding = "blocks"
    pl = ", ".join(repr(x) for x in placements)
    here = (f"rows {_describe(rows)} x cols {_describe(cols)} here" if rows
            else "nothing here")
    r.reason += f"; DTensor ({pl}), {here}"


def check(routes, pg, world, overlap_forward):
    """At construction, with DMuon's process group known: every Muon
    DTensor's mesh is that group, or one of copies of a sub-mesh that
    partition it (e.g. FSDP2 x TP's dp mesh of a parameter that is not
    tensor-parallel: one copy per tp coordinate). Sub-meshes cost one
    all_gather_object over the group, here. dmuond checks at OpenSession
    that the ranks' blocks cover each matrix."""
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

    want = list(range(world)) if pg is None else dist.get_process_group_ranks(pg)
    for r in dts:
        ranks = r.dtensor.mesh.mesh.flatten().tolist()
        outside = sorted(set(ranks) - set(want))
        if outside:
            raise _unsupported(
                r.name, r.param, f"its mesh spans ranks {ranks}, and {outside} are not "
                f"in DMuon's process group (ranks {want}); pass process_group= a group "
                "of every rank of the mesh (mesh.get_group() of a 1-D mesh)")
    if world > 1:
        _check_copies(dts, want, pg, world)


def _check_copies(dts, want, pg, world):
    """The Muon DTensors `dts` (the same on every rank) against every rank's
    (one all_gather_object over DMuon's group): each is on the group's
    mesh, or on sub-meshes that each hold their rank and are disjoint copies
    that together are the group. dmuond then reads each element from the
    lowest rank holding it and every copy receives the update (as HSDP's
    replicas): the copies must hold the same gradient, as a
    tensor-parallel model's replicated layers do. The same error on every
    rank."""
    mine = [(r.name, tuple(sorted(r.dtensor.mesh.mesh.flatten().tolist()))) for r in dts]
    every = _ddp.gather(mine, pg, world)
    for k, r in enumerate(dts):
        copies = {}
        for rank, theirs in zip(want, every):
            if k >= len(theirs) or theirs[k][0] != r.name:
                raise _unsupported(
                    r.name, r.param, f"rank {rank} has other Muon DTensors (the ranks' "
                    "models differ); build the same model on every rank")
            copies.setdefault(theirs[k][1], []).append(rank)
        if list(copies) == [tuple(sorted(want))]:
            continue  # the group's mesh
        for mesh, holders in sorted(copies.items()):
            stray = sorted(set(holders) - set(mesh))
            if stray:
                raise _unsupported(
                    r.name, r.param, f"rank {stray[0]} has it on a mesh of ranks "
                    f"{list(mesh)}, which does not hold that rank")
        seen = [x for mesh in copies for x in mesh]
        if len(seen) != len(set(seen)) or sorted(seen) != sorted(want):
            meshes = [list(m) for m in sorted(copies)]
            raise _unsupported(
                r.name, r.param, f"its meshes on the ranks of DMuon's process group "
                f"({want}) are {meshes}: not copies of one sub-mesh that partition the "
                "group")


def needs_collective(r, grad) -> bool:
    """Whether Route r's gradient `grad` must be redistributed (a DTensor
    collective) before it is handed over: a DTensor gradient whose
    placements are not the parameter's (Partial). Such a gradient is handed
    over at step(), never from a backward hook."""
    info = getattr(r, "dtensor", None)
    return (info is not None and grad is not None and is_dtensor(grad)
            and tuple(grad.placements) != tuple(info.placements))


def local_grad(r, grad):
    """The gradient to hand to dmuond for Route r: a DTensor's local tensor
    as it is (blocks), or the whole gradient (replicated). A gradient in
    other placements than the parameter's (Partial) is redistributed to them
    first."""
    info = getattr(r, "dtensor", None)
    if info is None or grad is None:
        return grad
    if not is_dtensor(grad):
        raise ValueError(
            f"DMuon: {r.name} is a DTensor but its .grad is a {type(grad).__name__}; "
            "a DTensor parameter's gradient must be a DTensor")
    if tuple(grad.placements) != tuple(info.placements):
        grad = grad.redistribute(grad.device_mesh, info.placements)
    return grad._local_tensor


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

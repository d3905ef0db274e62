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
hold the same gradient, as a tensor-parallel model's replicated layers do;
copies_differ() compares them at the first step() and DMuon raises if they
differ (torch.optim.Muon would let such copies drift apart).

Refused at construction, naming the parameter, on every rank alike: a
Partial parameter, a mesh with ranks outside DMuon's process group,
sub-meshes that are not such copies (a rank outside its own mesh,
overlapping meshes), a local shard other than torch's chunking
(DTensor.from_local(shape=...)), more runs than the protocol takes (4096
per list, 65536 row runs x column runs), shards= for a DTensor, and
overlap_forward=True (FSDP2 all-gathers in its own forward pre-hooks,
before DMuon's would apply the update).

Every other DTensor parameter (AdamW's) is left to torch.optim.AdamW, which
takes DTensors of any placement as they are.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

from . import _ddp, _routing
from ._routing import is_dtensor

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
    # A layout only this rank sees as wrong (route()), raised by check() on
    # every rank.
    refusal: Optional[ValueError] = None
    # On copies of a sub-mesh (check()): copies_differ() compares their
    # gradients at the first step.
    copies: bool = False


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
        "AdamW (routing_options=RoutingOptions(adamw=[...])), which takes any "
        "DTensor, or fix the layout")


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


def route_all(routes):
    """After _routing.resolve: lays out every Muon route whose parameter is a
    DTensor (route())."""
    for r in routes:
        if r.route == "muon" and is_dtensor(r.param):
            route(r, r.param)


def route(r, p):
    """Sets Route r (a Muon matrix that is DTensor p) to its sharding: this
    rank's local shard as runs (SHARDING_BLOCKS), or replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = p.device_mesh, tuple(p.placements)
    strided = _strided_cls()
    for pl in placements:
        if not (isinstance(pl, (Shard, Replicate)) or (strided and isinstance(pl, strided))):
            raise _unsupported(r.name, p, f"placement {pl} (a parameter must be "
                               "reduced: Shard, _StridedShard or Replicate)")
    # What only this rank can see (its coordinate, its local shard) is not
    # raised here: check() raises it on every rank alike, after gathering,
    # so that no rank is left waiting in a collective the others never make.
    replicated = all(isinstance(pl, Replicate) for pl in placements)
    r.dtensor = Info(placements, mesh) if replicated else Info(placements, mesh, [], [])
    r.sharding = "replicated" if replicated else "blocks"
    if mesh.get_coordinate() is None:
        r.dtensor.refusal = _unsupported(
            r.name, p, f"global rank {_global_rank()} has it on a mesh of ranks "
            f"{mesh.mesh.flatten().tolist()}, which does not hold that rank")
        return
    if replicated:
        r.reason += "; DTensor Replicate()"
        return
    want, _ = compute_local_shape_and_global_offset(p.shape, mesh, placements)
    if tuple(int(n) for n in want) != tuple(p._local_tensor.shape):
        r.dtensor.refusal = _unsupported(
            r.name, p, f"its local shard is {list(p._local_tensor.shape)} where torch's "
            f"chunking of its placements gives {list(want)}; a shard layout other than "
            "torch's is not supported")
        return
    got = _blocks(p, mesh, placements)
    if isinstance(got, str):
        r.dtensor.refusal = _unsupported(r.name, p, got)
        return
    rows, cols = got
    if (len(rows) > MAX_RUNS or len(cols) > MAX_RUNS
            or len(rows) * len(cols) > MAX_RUN_PRODUCT):
        r.dtensor.refusal = _unsupported(
            r.name, p, f"its local shard is {len(rows)} row runs x {len(cols)} column "
            f"runs of the {r.matrix[0]}x{r.matrix[1]} matrix; the protocol takes at "
            f"most {MAX_RUNS} runs per list and {MAX_RUN_PRODUCT} row runs x column runs")
        return
    r.dtensor = Info(placements, mesh, rows, cols)
    r.sharding = "blocks"
    pl = ", ".join(repr(x) for x in placements)
    here = (f"rows {_describe(rows)} x cols {_describe(cols)} here" if rows
            else "nothing here")
    r.reason += f"; DTensor ({pl}), {here}"


def check(routes, pg, world, overlap_forward):
    """At construction, with DMuon's process group known, on every rank of
    it (one all_gather_object when world > 1, whatever the parameters: a
    rank must not skip it): every Muon DTensor is the same on every rank
    (name, shape, placements), no rank refused its layout (route()), and
    its mesh is the group, or the ranks' meshes partition the group (copies
    of a sub-mesh, e.g. FSDP2 x TP's dp mesh of a parameter that is not
    tensor-parallel: one copy per tp coordinate). Any refusal is raised on
    every rank alike. dmuond checks at OpenSession that the ranks' blocks
    cover each matrix, reads each element from the lowest rank holding it
    and updates every copy (as HSDP's replicas): copies must hold the same
    gradient, as a tensor-parallel model's replicated layers do."""
    dts = [r for r in routes if r.route == "muon" and getattr(r, "dtensor", None)]
    if dts and overlap_forward:
        raise ValueError(
            f"DMuon: OverlapOptions(forward=True) with DTensor parameters "
            f"({dts[0].name}, ...) is not supported yet: FSDP2 all-gathers a module's "
            "parameters in its own forward pre-hook, before DMuon's would apply their "
            "update. Pass overlap_options=OverlapOptions(forward=False) (updates are "
            "applied in step())")
    import torch.distributed as dist

    want = list(range(world)) if pg is None else dist.get_process_group_ranks(pg)
    refusal = next((r.dtensor.refusal for r in dts if r.dtensor.refusal), None)
    for r in dts:
        if refusal is not None:
            break
        ranks = r.dtensor.mesh.mesh.flatten().tolist()
        outside = sorted(set(ranks) - set(want))
        if outside:
            refusal = _unsupported(
                r.name, r.param, f"its mesh spans ranks {ranks}, and {outside} are not "
                f"in DMuon's process group (ranks {want}); pass process_group= a group "
                "of every rank of the mesh (mesh.get_group() of a 1-D mesh)")
    if world == 1:
        if refusal is not None:
            raise refusal
        return
    every = _ddp.gather(_report(dts, refusal), pg, world)
    _check_reports(dts, want, every)


def _report(dts, refusal):
    """This rank's part of check()'s gather, small whatever the world size:
    (its refusal's text or None, a digest of its Muon DTensors' names,
    shapes and placements, each distinct mesh once as (a hash of its
    ranks, its size), the index of each matrix's mesh in that list)."""
    import hashlib

    table = repr([(r.name, tuple(r.param.shape), tuple(map(repr, r.dtensor.placements)))
                  for r in dts])
    meshes, index = [], []
    for r in dts:
        ranks = tuple(sorted(r.dtensor.mesh.mesh.flatten().tolist()))
        key = (hashlib.sha256(repr(ranks).encode()).hexdigest()[:16], len(ranks))
        if key not in meshes:
            meshes.append(key)
        index.append(meshes.index(key))
    return (None if refusal is None else str(refusal),
            hashlib.sha256(table.encode()).hexdigest(), meshes, index)


def _check_reports(dts, want, every):
    """check() on what every rank of the group (global ranks `want`, in
    order) reported (_report): raises the same ValueError on every rank."""
    for rank, (refusal, _, _, _) in zip(want, every):
        if refusal is not None:
            raise ValueError(refusal if rank == _global_rank()
                             else f"{refusal} (refused on rank {rank})")
    digest = every[0][1]
    for rank, (_, theirs, _, _) in zip(want, every):
        if theirs != digest:
            raise ValueError(
                f"DMuon: rank {rank}'s Muon DTensor parameters (names, shapes, "
                f"placements) are not rank {want[0]}'s; build the same model, sharded "
                "the same way, on every rank")
    for k, r in enumerate(dts):
        holders = {}  # (mesh hash, mesh size) -> the ranks that have it so
        for rank, (_, _, meshes, index) in zip(want, every):
            holders.setdefault(meshes[index[k]], []).append(rank)
        # Every rank is in its own mesh (route()), the meshes hold no rank
        # outside the group (check()): a mesh of n ranks that n ranks report
        # is exactly those ranks, so the meshes partition the group.
        if len(holders) > 1 or next(iter(holders))[1] != len(want):
            r.dtensor.copies = True
        for (_, size), ranks in holders.items():
            if len(ranks) != size:
                shown = ", ".join(str(x) for x in ranks[:8])
                raise _unsupported(
                    r.name, r.param, f"{len(ranks)} rank(s) ({shown}"
                    f"{' ...' if len(ranks) > 8 else ''}) have it on a mesh of {size} "
                    "ranks: the ranks' meshes are neither DMuon's process group nor a "
                    "partition of it (copies of a sub-mesh)")


def copies_differ(routes, pg, world) -> Optional[str]:
    """At the first step(), on every rank (one all_gather_object): whether
    the copies of a Muon DTensor on a sub-mesh hold different gradients,
    which dmuond would not see (it reads each element from the lowest rank
    holding it): the error's text, or None. Ranks with the same runs hold
    the same elements; their local gradients' norms and sums must agree to
    1e-4 of the norm and of the sum of magnitudes (not bit for bit: GPU
    reductions may differ in the last bits). A gradient not reduced yet
    (Partial) is reduced to compare it."""
    import torch.distributed as dist

    mine = []
    for r in routes:
        info = getattr(r, "dtensor", None)
        if info is None or not info.copies:
            continue
        g = _routing.grad(r)
        summary = None
        if g is not None:
            # A Partial gradient is reduced first (DTensor's collective, in
            # table order on every rank; step() reduces it again to hand it
            # over: once, at the first step).
            x = (local_grad(r, g) if needs_collective(r, g) else local(g)).detach().double()
            summary = (float(x.norm()), float(x.sum()), float(x.abs().sum()))
        # Ranks with the same runs hold the same elements; every rank holds
        # the whole of an all-Replicate() matrix (row_runs None).
        runs = ((tuple(info.row_runs), tuple(info.col_runs))
                if info.row_runs is not None else ("whole", "whole"))
        mine.append((r.name, runs, summary))
    want = list(range(world)) if pg is None else dist.get_process_group_ranks(pg)
    every = _ddp.gather(mine, pg, world)
    seen = {}  # (name, runs) -> (rank, summary) of the lowest rank
    for rank, theirs in zip(want, every):
        for name, runs, summary in theirs:
            if not runs[0]:
                continue  # holds nothing
            first = seen.setdefault((name, runs), (rank, summary))
            a, b = first[1], summary
            if a == b:
                continue
            if (a is None or b is None or abs(a[0] - b[0]) > 1e-4 * max(a[0], b[0])
                    or abs(a[1] - b[1]) > 1e-4 * max(a[2], b[2])):
                return (
                    f"DMuon: the copies of {name} on a sub-mesh have different gradients: "
                    f"ranks {first[0]} and {rank} hold the same elements, with {_said(a)} "
                    f"and {_said(b)}; dmuond would use rank {first[0]}'s. Copies must hold "
                    "the same gradient (a tensor-parallel model's replicated layers: the "
                    "same input on every tp rank); route it to AdamW (routing_options="
                    "RoutingOptions(adamw=[...])), which steps each copy with its own "
                    "gradient, if they should differ")
    return None


def _said(summary):
    return "None" if summary is None else f"norm {summary[0]:.6g}, sum {summary[1]:.6g}"


def _global_rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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

"""torch.distributed plumbing for DMuon: the job id every rank agrees on, the
collective check that every rank opened its session, and the DDP comm hook
that hands Muon gradients to dmuond straight from DDP's buckets.

The comm hook replaces DDP's default all-reduce. Per bucket it
  - all-reduces (mean, like DDP's default) the gradients of AdamW parameters;
  - replicated Muon parameters: all-reduces them too, then hands each one's
    mean gradient to dmuond as soon as its bucket is reduced (rank 0's copy is
    the one the daemon reads; other ranks only declare it ready);
  - reduce_in_daemon (unreduced) and row-sharded Muon parameters: hands each
    rank's local gradient to dmuond at once and leaves them out of the
    all-reduce entirely; the daemon averages (or gathers) them.
"""

import os
import socket
import uuid

import torch
import torch.distributed as dist


def world(process_group):
    """(group, rank, world_size); (None, 0, 1) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("DMuon: process_group= given but torch.distributed "
                             "is not initialized")
        return None, 0, 1
    group = process_group or dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _src(group):
    """The global rank of the group's rank 0."""
    try:
        return dist.get_global_rank(group, 0)
    except (AttributeError, RuntimeError):
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_global_rank(group, 0)


def broadcast(obj, group):
    box = [obj]
    dist.broadcast_object_list(box, src=_src(group), group=group)
    return box[0]


def gather(obj, group, world_size):
    out = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def new_job_id():
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def any_rank(flag, group):
    """Whether `flag` is true on some rank of `group`: one all-reduce (MAX)
    of a single int32, on the GPU for an nccl-only group, else on the CPU."""
    dev = (torch.device("cuda", torch.cuda.current_device())
           if str(dist.get_backend(group)) == "nccl" else torch.device("cpu"))
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def barrier(group):
    if group is not None:
        dist.barrier(group=group)


def _completed(tensor):
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def comm_hook(handoff_ref, group, world_size):
    """A DDP comm hook bound (weakly) to a DMuon hand-off (dmuon/_handoff.py)."""

    def hook(state, bucket):
        buf = bucket.buffer()
        owner = handoff_ref()
        plan = owner.bucket_plan(bucket.parameters()) if owner is not None else []
        local = [(i, o, n) for i, kind, o, n in plan if kind == "local"]
        after = [(i, o, n) for i, kind, o, n in plan if kind == "after"]
        reduce = [(o, n) for _, kind, o, n in plan if kind in ("reduce", "after")]
        if owner is None:  # "skip": handed off at step(), never all-reduced
            reduce = [(0, buf.numel())]
        for i, o, n in local:
            owner.handoff_flat(i, buf[o : o + n])
        if not reduce:
            return _completed(buf)
        whole = len(reduce) == 1 and reduce[0] == (0, buf.numel())
        compact = buf if whole else torch.cat([buf[o : o + n] for o, n in reduce])
        compact.div_(world_size)
        fut = dist.all_reduce(compact, group=group, async_op=True).get_future()

        def done(f):
            reduced = f.value()[0]
            if not whole:
                at = 0
                for o, n in reduce:
                    buf[o : o + n].copy_(reduced[at : at + n])
                    at += n
            owner = handoff_ref()
            if owner is not None:
                for i, o, n in after:
                    owner.handoff_flat(i, buf[o : o + n])
            return buf

        return fut.then(done)

    return hook

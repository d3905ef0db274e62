"""One rank of a 2-process torch.distributed (gloo) job for test_distributed.

Writes {"params": {name: tensor}, "error": str or None} to --out."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from dmuon.optim import DMuon  # noqa: E402
from helpers import MLP, TinyLM, lm_batch, loss_of  # noqa: E402
from ranks import worker_args, worker_main  # noqa: E402

STEPS = 8
CLIP = 0.05  # clip_grad_norm_'s max_norm (modes *_clip*)
HYPER = dict(lr=0.02, weight_decay=0.1, adamw_lr=3e-3)


def local(batch, rank, world):
    x, y = batch
    n = x.shape[0] // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def run_ddp(args, rank, world):
    torch.manual_seed(0)
    model = TinyLM()
    server = args.server.split(",") if "," in args.server else args.server
    if args.mode == "ddp_ignore":  # the unwrapped model: DMuon marks, then DDP
        opt = DMuon(model, server=server, adamw=[model.head],
                    reduce_in_daemon=True, **HYPER)
        ddp = DDP(model)
    else:
        ddp = DDP(model)
        opt = DMuon(ddp, server=server, adamw=[model.head],
                    reduce_in_daemon=args.mode in ("ddp_reduce", "ddp_accum")
                    or args.mode.startswith("ddp_reduce_clip"),
                    overlap=not args.mode.endswith("_nooverlap"), **HYPER)
    routes = {r["name"]: (r["sharding"], r["handoff"]) for r in opt.routing
              if r["route"] == "muon"}
    for s in range(STEPS):
        x, y = local(lm_batch(s), rank, world)
        if args.mode == "ddp_accum":  # two micro-batches, DDP's no_sync first
            with ddp.no_sync():
                (loss_of(ddp, (x[:2], y[:2])) / 2).backward()
            (loss_of(ddp, (x[2:], y[2:])) / 2).backward()
        elif args.mode == "ddp_accum_sync":  # two micro-batches, both all-reduced
            (loss_of(ddp, (x[:2], y[:2])) / 2).backward()
            (loss_of(ddp, (x[2:], y[2:])) / 2).backward()
        elif args.mode == "ddp_ignore":
            loss_of(ddp, (x, y)).backward()
        else:
            loss_of(ddp, (x, y)).backward()
        if "clip" in args.mode:  # after the hand-off (overlap): a rewind
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        if s == 0:  # after backward: which gradients did DDP all-reduce?
            for key, p in (("muon", model.blocks[0].qkv.weight), ("adamw", model.norm.weight)):
                seen = [torch.zeros_like(p.grad) for _ in range(world)]
                dist.all_gather(seen, p.grad)
                routes[f"{key}_grads_equal"] = torch.equal(seen[0], seen[1])
        opt.step()
        opt.zero_grad()
    if args.mode == "ddp_pool":  # server "a,b": the split every rank used
        routes["pool_owner"] = opt.pool_owner
    routes["redone_steps"] = opt.stats.get("redone_steps", 0)
    routes["rewound_steps"] = opt.stats.get("rewound_steps", 0)
    opt.close()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, routes


def run_rows(args, rank, world):
    torch.manual_seed(0)
    full = torch.randn(16, 24) * 0.1
    rows = 16 // world
    w = torch.nn.Parameter(full[rank * rows:(rank + 1) * rows].clone())
    opt = DMuon([w], server=args.server, shards={w: (rank * rows, (rank + 1) * rows, 16)},
                lr=0.02, weight_decay=0.1)
    # rows_cycled: OneCycleLR cycles the momentum, which every rank sends
    # with its rows (GradientsReady.momentum).
    sched = (torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.04, total_steps=STEPS)
             if args.mode == "rows_cycled" else None)
    for s in range(STEPS):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(8, 24, generator=g), torch.randn(8, 16, generator=g)
        ((x @ w.t() - y[:, rank * rows:(rank + 1) * rows]) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    checks = None
    if args.mode == "rows":  # state_dict: the whole matrix in "dmuon", both ways
        sd = opt.state_dict()
        whole = sd["dmuon"]["row_sharded_momentum"]
        checks = {"state": sorted(sd["state"][0]),
                  "whole": {n: tuple(m.shape) for n, m in whole.items()}}
        opt.load_state_dict(sd)
        again = opt.state_dict()["dmuon"]["row_sharded_momentum"]
        checks["same"] = all(torch.equal(again[n], m) for n, m in whole.items())
        del sd["dmuon"]  # as DCP keeps it
        try:
            opt.load_state_dict(sd)
        except ValueError as e:
            checks["without_dmuon"] = str(e)
    opt.close()
    return {"w": w.detach().clone()}, checks


class _Branchy(torch.nn.Module):
    """A trunk and a branch that only some ranks use in some steps."""

    def __init__(self):
        super().__init__()
        self.fc1, self.branch, self.fc2 = (torch.nn.Linear(12, 16), torch.nn.Linear(16, 16),
                                           torch.nn.Linear(16, 6))

    def forward(self, x, use_branch):
        h = torch.tanh(self.fc1(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.fc2(h)


def run_unused(args, rank, world):
    """The branch is used on rank 0 only, every other step. unused_ddp: DDP
    (find_unused_parameters) all-reduces, and every rank gets the branch's
    gradient averaged with rank 1's zeros (none in the steps no rank uses
    it); unused_daemon: DMuon hands each rank's own gradient to dmuond
    (reduce_in_daemon), rank 1 declares the branch absent, and dmuond must
    average it the same way."""
    torch.manual_seed(0)
    model = _Branchy()
    if args.mode == "unused_daemon":
        opt = DMuon(model, server=args.server, reduce_in_daemon=True, **HYPER)
        ddp = DDP(model, find_unused_parameters=True)
    else:
        ddp = DDP(model, find_unused_parameters=True)
        opt = DMuon(ddp, server=args.server, **HYPER)
    route = next(r for r in opt.routing if r["name"] == "branch.weight")
    for s in range(STEPS):
        x, y = unused_batch(s, rank)
        torch.nn.functional.mse_loss(ddp(x, s % 2 == 1 and rank == 0), y).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {"handoff": route["handoff"], "sharding": route["sharding"]})


def unused_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)


def run_mismatch(args, rank, world):
    model = MLP(hidden=48 if rank == 0 else 40)
    DMuon(model, server=args.server, timeout=10.0)
    return {}, None


def main():
    args = worker_args().parse_args()
    fn = {"rows": run_rows, "rows_cycled": run_rows, "unused_ddp": run_unused,
          "unused_daemon": run_unused, "mismatch": run_mismatch}.get(args.mode, run_ddp)
    worker_main(args, lambda a: dict(zip(("params", "routes"), fn(a, a.rank, a.world))),
                initial={"params": {}, "routes": None})


if __name__ == "__main__":
    main()

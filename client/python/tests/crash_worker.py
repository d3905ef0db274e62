"""One rank of test_crash_resume's FSDP2 trainer (gloo, CPU): trains
fsdp_worker's model to --total steps against one dmuond, checkpointing with
DCP every --every steps in reference mode (DaemonOptions(checkpoint_momentum=
"reference"): the Muon momentum is dmuond's mark of the step), and dies
where the launcher asked.

At start each rank loads the newest complete checkpoint under --ckpt
(step-N/ with its COMPLETE marker, written by rank 0 after dcp.save
returned on every rank: a checkpoint without it is ignored) and opens job
--job with resume=N; with none, resume="replace" starts the job over.

--kill=STEP:PHASE: on reaching PHASE of step STEP (0-based: the step that
makes STEP + 1 completed steps) rank 0 creates --signal and waits, and the
launcher SIGKILLs every rank. PHASE: "backward" (in the backward pass, some
gradients already handed to dmuond), "step" (inside opt.step(), in its
AdamW half while dmuond computes), "checkpoint" (inside dcp.save of the
checkpoint after that step, its data written, its metadata not).

Writes {"start": N, "params": {name: full tensor}, "error"} to --out after
the last step."""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

import fsdp_worker  # noqa: E402
from dmuon import AdamWOptions, DaemonOptions, RoutingOptions  # noqa: E402
from dmuon.optim import DMuon  # noqa: E402
from ranks import worker_args, worker_main  # noqa: E402
from torch_ref import ADAMW, MUON  # noqa: E402

COMPLETE = "COMPLETE"


def newest_complete(root):
    """The step of the newest checkpoint under root with its marker, or 0."""
    steps = [int(d.split("-")[1]) for d in os.listdir(root)
             if d.startswith("step-") and os.path.exists(os.path.join(root, d, COMPLETE))]
    return max(steps, default=0)


class Killer:
    """Rank 0 at the kill point: tells the launcher, then waits for SIGKILL."""

    def __init__(self, spec, signal_file, rank):
        step, phase = spec.split(":") if spec else (-1, "")
        self.step, self.phase, self.signal, self.rank = int(step), phase, signal_file, rank
        self.now = None  # the step being trained

    def at(self, phase):
        if self.rank == 0 and phase == self.phase and self.now == self.step:
            with open(self.signal, "w") as f:
                f.write(f"{self.step}:{phase}\n")
            time.sleep(600)


class KillingWriter(dcp.FileSystemWriter):
    """dcp.save's storage: its data written, then the kill point, before
    the metadata."""

    def __init__(self, path, killer):
        super().__init__(path)
        self.killer = killer

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        fut.wait()
        self.killer.at("checkpoint")
        return fut


def state(model, opt):
    return {"model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt)}


def run(args):
    rank, world = args.rank, args.world
    model, loss_of = fsdp_worker.fsdp(rank, world)
    start = newest_complete(args.ckpt)
    opts = DaemonOptions(args.server, job_id=args.job, checkpoint_momentum="reference",
                         resume=start if start else "replace")
    opt = DMuon(model, **MUON, adamw_options=AdamWOptions(**ADAMW), daemon_options=opts,
                routing_options=RoutingOptions(muon=["4.weight"]))
    killer = Killer(args.kill, args.signal, rank)
    if start:
        sd = state(model, opt)  # the destination; marks step `start` again: a no-op
        dcp.load(sd, checkpoint_id=os.path.join(args.ckpt, f"step-{start}"))
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
    print(f"rank {rank}/{world}: from step {start}, dmuond at {opt.session.step - 1}",
          flush=True)
    model[2].register_full_backward_hook(lambda *_: killer.at("backward"))
    register_optimizer_step_pre_hook(
        lambda o, *_: killer.at("step") if isinstance(o, torch.optim.AdamW) else None)
    for s in range(start, args.total):
        killer.now = s
        loss_of(*fsdp_worker.batch(s)).backward()
        opt.step()
        opt.zero_grad()
        if (s + 1) % args.every == 0 and s + 1 < args.total:
            path = os.path.join(args.ckpt, f"step-{s + 1}")
            dcp.save(state(model, opt), storage_writer=KillingWriter(path, killer))
            dist.barrier()  # every rank's dcp.save returned
            if rank == 0:
                with open(os.path.join(path, COMPLETE), "w") as f:
                    f.write(f"{s + 1}\n")
    opt.close()
    return {"start": start,
            "params": {n: fsdp_worker.full(p) for n, p in model.named_parameters()}}


def main():
    ap = worker_args()
    for name in ("--ckpt", "--job", "--signal"):
        ap.add_argument(name, required=True)
    ap.add_argument("--kill", default="")
    ap.add_argument("--total", type=int, required=True)
    ap.add_argument("--every", type=int, default=2)
    args = ap.parse_args()
    worker_main(args, run)


if __name__ == "__main__":
    main()

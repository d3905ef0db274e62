"""One rank of a torch.distributed (gloo) job for test_dcp: DMuon saved with
torch.distributed.checkpoint on one world size, loaded on another.

--mode=save (fsdp_save: FSDP2, DTensor parameters; fsdp_tp_save: FSDP2 x
TP on a 2-D mesh): trains --steps steps from scratch, then dcp.save()s the
model and get_optimizer_state_dict() to --ckpt.
--mode=load (fsdp_load, fsdp_tp_load): a fresh DMuon; get_*_state_dict() as dcp.load's
destination, dcp.load, set_*_state_dict, then trains --steps more steps
from --start.
--reference: checkpoint_momentum="reference" on job --job (the momentum is
dmuond's mark of the saved step; load opens the job with resume=--start);
--past=n: save trains n more steps after saving (the job moves past it).

Writes {"params", "momentum" (dmuond's, by table name),
"completed": {when: completed_steps}, "error"} to --out."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from dmuon import DaemonOptions  # noqa: E402
from dmuon.optim import DMuon  # noqa: E402
from helpers import TinyLM, lm_batch, loss_of  # noqa: E402
from ranks import worker_args, worker_main  # noqa: E402

HYPER = dict(lr=0.02, weight_decay=0.1, adamw_lr=3e-3)


def local(batch, rank, world):
    x, y = batch
    n = x.shape[0] // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def completed(opt):
    return int(opt.session.get_state()["completed_steps"])


def daemon_momentum(opt):
    """dmuond's momentum by table name (whole matrices, every rank's)."""
    st = opt.session.get_state()
    return {n: torch.from_numpy(m).clone() for n, m in zip(st["names"], st["momentum"])}


def daemon(args):
    """DMuon's daemon keywords: --reference, a reference checkpoint
    (checkpoint_momentum="reference") of job --job, loaded with
    resume=--start; else the server alone."""
    if not args.reference:
        return dict(server=args.server)
    load = args.mode.endswith("load")
    return dict(daemon_options=DaemonOptions(
        args.server, job_id=args.job, checkpoint_momentum="reference",
        resume=args.start if load else "fresh"))


def ddp_job(args, rank, world):
    torch.manual_seed(args.seed)  # load: other weights than the saved ones
    model = TinyLM()
    ddp = DDP(model)
    opt = DMuon(ddp, adamw=[model.head], **daemon(args), **HYPER)

    def loss(s):
        return loss_of(ddp, local(lm_batch(s), rank, world))

    return model, ddp, opt, loss, "blocks.0.qkv.weight"


def fsdp_job(args, rank, world):
    """FSDP2 (fully_shard) on a 1-D CPU mesh (fsdp_*: Shard(0)), or FSDP2 x
    TP on a (dp=2, tp=world/2) mesh (fsdp_tp_*): fsdp_worker's models, its
    loss over each rank's (dp group's) slice of the batch."""
    import fsdp_worker

    build = fsdp_worker.fsdp_tp if args.mode.startswith("fsdp_tp_") else fsdp_worker.fsdp
    model, fsdp_loss = build(rank, world)
    if args.mode.endswith("load"):  # other weights than the saved ones
        with torch.no_grad():
            for p in model.parameters():
                p._local_tensor.mul_(0.5)
    opt = DMuon(model, muon=["4.weight"], **daemon(args), **fsdp_worker.HYPER)

    def loss(s):
        return fsdp_loss(*fsdp_worker.batch(s))

    return model, model, opt, loss, "0.weight"


def run(args, rank, world):
    make = fsdp_job if args.mode.startswith("fsdp") else ddp_job
    model, ddp, opt, loss, probe = make(args, rank, world)
    args.mode = args.mode.rsplit("_", 1)[-1]  # save or load
    out = {"completed": {}}
    if args.mode == "load":
        sd = {"model": get_model_state_dict(ddp),
              "optim": get_optimizer_state_dict(ddp, opt)}
        out["completed"]["fresh"] = completed(opt)  # _init_optim_state: no step
        dcp.load(sd, checkpoint_id=args.ckpt)
        set_model_state_dict(ddp, sd["model"])
        set_optimizer_state_dict(ddp, opt, sd["optim"])
        out["completed"]["loaded"] = completed(opt)
        out["loaded_momentum"] = daemon_momentum(opt)
    for s in range(args.start, args.start + args.steps):
        loss(s).backward()
        opt.step()
        opt.zero_grad()
    if args.mode == "save":
        out["momentum"] = daemon_momentum(opt)
        osd = get_optimizer_state_dict(ddp, opt)
        out["completed"]["saved"] = completed(opt)
        out["layout"] = {k: (type(v).__name__, tuple(v.shape), v.dtype,
                             str(getattr(v, "placements", None)))
                         for k, v in osd["state"][probe].items()}
        dcp.save({"model": get_model_state_dict(ddp), "optim": osd},
                 checkpoint_id=args.ckpt)
        for s in range(args.start + args.steps, args.start + args.steps + args.past):
            loss(s).backward()  # past the checkpoint: the job moves on, then is lost
            opt.step()
            opt.zero_grad()
    out["completed"]["end"] = completed(opt)
    opt.close()
    out["params"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                     .clone() for n, p in model.named_parameters()}
    return out


def main():
    ap = worker_args()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--job", default=None)
    ap.add_argument("--past", type=int, default=0, help="save: steps after the save")
    args = ap.parse_args()
    worker_main(args, lambda a: run(a, a.rank, a.world))


if __name__ == "__main__":
    main()

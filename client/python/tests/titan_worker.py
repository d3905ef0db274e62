"""One rank of a torchtitan Trainer job for test_torchtitan: torchtitan
0.3.0's own Trainer (a tiny debug llama, FSDP2 over the gloo ranks, its
gradient clipping, LR warmup and decay, CheckpointManager) with one of two
optimizer containers:

  --mode=dmuon   dmuon.integrations.torchtitan.DMuonOptimizersContainer
                 (--no-overlap: overlap_backward=False; --lr-scale: its
                 Muon lr times that)
  --mode=torch   torchtitan's OptimizersContainer with torch.optim.Muon
                 (fp32 Newton-Schulz, torch_ref) for the matrices and
                 torch.optim.AdamW for the rest, by ParamGroupConfig
  --mode=save    dmuon, checkpointing at step --save-at and ending there
                 (a kill: no close, os._exit)
  --mode=resume  dmuon, a fresh Trainer loading that checkpoint

Writes {"losses": [(step, loss, grad_norm)], "params": {fqn: full
parameter} at the end, "routes": {fqn: "muon" | "adamw"} (dmuon), "error"}
to --out. Hyperparameters: torch_ref's MUON and ADAMW.
"""

import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import titan_cpu  # noqa: E402 (first: before torchtitan)
import torch  # noqa: E402
import torch.optim._muon as _muon  # noqa: E402
from ranks import worker_args, worker_main  # noqa: E402
from torch_ref import fp32_newton_schulz  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import (  # noqa: E402
    LRSchedulersContainer, OptimizersContainer, ParamGroupConfig)
from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from dmuon.integrations.torchtitan import DMuonOptimizersContainer  # noqa: E402

STEPS = 6
# Small enough that torchtitan's clip_grad_norm_ clips every step.
MAX_NORM = 0.5
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5,
            eps=1e-7, adjust_lr_fn="match_rms_adamw")
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
# torchtitan's llama3 matrices: attention.qkv_linear.wqkv (fused), attention.wo and
# feed_forward.w1/w2/w3 of every layer (the head, lm_head, stays AdamW's).
MATRICES = r"^layers\.\d+\.(attention|feed_forward)\.[a-z0-9_.]*weight$"


class TorchMuonContainer(OptimizersContainer):
    """torchtitan's own container, knowing torch.optim.Muon by name (its
    factory table has Adam, AdamW and DistMuon only)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name):
        if name == "Muon":
            return torch.optim.Muon
        return OptimizersContainer._resolve_optimizer_factory(name)


def optimizer(args, lr_scale=1.0):
    if args.mode == "torch":
        _muon._zeropower_via_newtonschulz = fp32_newton_schulz
        return TorchMuonContainer.Config(implementation="for-loop", param_groups=[
            ParamGroupConfig(pattern=MATRICES, optimizer_name="Muon",
                             optimizer_kwargs=MUON),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                             optimizer_kwargs=ADAMW)])
    return DMuonOptimizersContainer.Config(
        **dict(MUON, lr=MUON["lr"] * lr_scale),
        **{f"adamw_{k}": v for k, v in ADAMW.items()},
        server=args.server, overlap_backward=not args.no_overlap)


def config(args):
    checkpoint = args.mode in ("save", "resume")
    return Trainer.Config(
        model_spec=titan_cpu.tiny_llama(),
        dump_folder=args.dump,
        tokenizer=titan_cpu.Tokenizer.Config(),
        dataloader=titan_cpu.Loader.Config(),
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=titan_cpu.VOCAB)),
        optimizer=optimizer(args, args.lr_scale),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(
            local_batch_size=titan_cpu.BATCH, seq_len=titan_cpu.SEQ_LEN, steps=STEPS,
            max_norm=MAX_NORM, mixed_precision_param="float32", disable_cuda_graphs=True),
        parallelism=ParallelismConfig(data_parallel_shard_degree=args.world),
        checkpoint=CheckpointManager.Config(
            enable=checkpoint, folder="checkpoint", interval=args.save_at,
            last_save_model_only=False),
        activation_checkpoint=None,
        metrics=MetricsProcessor.Config(log_freq=1),
        debug=DebugConfig(seed=0),
    )


def run(args):
    os.environ["LOCAL_RANK"] = str(args.rank)  # as torchrun sets it
    trainer = Trainer(config(args))
    losses = []
    log = trainer.metrics_processor.log

    def record(step, loss, max_loss, grad_norm, **kwargs):
        losses.append((step, loss, grad_norm))
        return log(step, loss, max_loss, grad_norm, **kwargs)

    trainer.metrics_processor.log = record
    if args.mode == "save":  # end after the checkpoint of step --save-at
        trainer.should_continue_training = lambda: trainer.step < args.save_at
    trainer.train()
    model = trainer.model_parts[0]
    params = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    out = dict(losses=losses, params=params, step=trainer.step)
    if args.mode != "torch":
        opt = trainer.optimizers.optimizers[0]
        out["routes"] = {n: ("muon" if g["use_muon"] else "adamw")
                         for g in opt.param_groups for n in g["param_names"]}
    if args.mode != "save":
        trainer.close()
    return out


if __name__ == "__main__":
    ap = worker_args()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--save-at", type=int, default=STEPS)
    ap.add_argument("--lr-scale", type=float, default=1.0)
    ap.add_argument("--no-overlap", action="store_true")
    worker_main(ap.parse_args(), run)

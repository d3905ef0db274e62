"""DMuon in Hugging Face `transformers.Trainer`: a tiny randomly initialised
Llama (built from a LlamaConfig, nothing downloaded), trained with gradient
clipping (max_grad_norm=1.0) on random tokens.

    PYTHONPATH=client/python .venv/bin/python client/python/examples/hf_trainer.py \
        [--steps 10] [--server auto|host:port] [--compare]

The Trainer takes DMuon like any optimizer: `optimizers=(opt, None)` (its
linear-decay scheduler is made for it) or `optimizer_cls_and_kwargs=(DMuon,
{...})`. Gradients leave for dmuond from backward's hooks; when the Trainer's
clip_grad_norm_ then clips them, DMuon's step() sees it and has dmuond redo
the step with the clipped gradients (exact; client/python/README.md,
"Editing gradients after backward()"). --compare trains the same model with
torch.optim.Muon (fp32 Newton-Schulz) + AdamW and prints the largest
difference.
"""

import argparse
import copy
import sys
import tempfile

import torch
from torch import nn

MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         initializer_range=0.2)  # gradients of norm > 1: clipped
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16, vocab=96, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def muon_matrices(model):
    """torch.optim.Muon's share, as DMuon routes it with adamw=[lm_head]: the
    Linear weights of the blocks; embeddings, norms and the head go to AdamW."""
    mats = [m.weight for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not n.endswith("lm_head")]
    ids = {id(p) for p in mats}
    return mats, [p for p in model.parameters() if id(p) not in ids]


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon for the matrices plus torch.optim.AdamW for the rest,
    as one optimizer (the Trainer and Lightning take one): the reference."""

    def __init__(self, model, muon_cls=None):
        mats, rest = muon_matrices(model)
        super().__init__(list(model.parameters()), {})
        self.inner = [(muon_cls or torch.optim.Muon)(mats, **MUON),
                      torch.optim.AdamW(rest, **ADAMW)]

    # The inner optimizers' own group dicts, so that an LR scheduler's changes
    # reach them, also after a load_state_dict (accelerate's prepare does one).
    @property
    def param_groups(self):
        return [g for o in getattr(self, "inner", ()) for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, groups):
        if hasattr(self, "inner") and len(groups) == len(self.param_groups):
            k = 0
            for o in self.inner:
                n = len(o.param_groups)
                for mine, new in zip(o.param_groups, groups[k:k + n]):
                    mine.update({key: v for key, v in new.items() if key != "params"})
                k += n

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.inner:
            o.step()
        return loss

    def zero_grad(self, set_to_none=True):
        for o in self.inner:
            o.zero_grad(set_to_none=set_to_none)


def dmuon_for(model, server="auto"):
    from dmuon import AdamWOptions, DaemonOptions, RoutingOptions
    from dmuon.optim import DMuon
    return DMuon(model, **MUON, adamw_options=AdamWOptions(**ADAMW),
                 daemon_options=DaemonOptions(server),
                 routing_options=RoutingOptions(adamw=[model.lm_head]))


def train(model, optimizer, steps=10, max_grad_norm=1.0, on_step=None):
    """transformers.Trainer over RandomTokens, CPU, fp32, deterministic.
    `on_step(model)` after every optimizer step."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Each(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if on_step is not None:
                on_step(model)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=8,
            learning_rate=MUON["lr"], max_grad_norm=max_grad_norm, use_cpu=True,
            report_to=[], save_strategy="no", logging_strategy="no", seed=0,
            data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(),
                          optimizers=(optimizer, None), callbacks=[Each()])
        return trainer.train().training_loss


def snapshots(model, steps, make_optimizer):
    seen = []
    opt = make_optimizer(model)
    try:
        loss = train(model, opt, steps,
                     on_step=lambda m: seen.append([p.detach().clone()
                                                    for p in m.parameters()]))
    finally:
        if hasattr(opt, "close"):
            opt.close()
    return loss, seen, opt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="training steps")
    ap.add_argument("--server", default="auto", help="auto or host:port of a dmuond")
    ap.add_argument("--compare", action="store_true",
                    help="also train with torch.optim.Muon (fp32 Newton-Schulz) + AdamW and "
                    "print the largest difference")
    a = ap.parse_args()
    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    loss, dm, opt = snapshots(model, a.steps, lambda m: dmuon_for(m, a.server))
    print(f"DMuon: {a.steps} steps, training loss {loss:.4f}, steps dmuond redid "
          f"after clipping: {opt.stats['redone_steps']}")
    if a.compare:
        ref_loss, ref, _ = snapshots(ref_model, a.steps, MuonAdamW)
        worst = max(((x - y).norm() / y.norm()).item()
                    for a_, b_ in zip(dm, ref) for x, y in zip(a_, b_))
        print(f"torch.optim.Muon + AdamW: training loss {ref_loss:.4f}; largest relative "
              f"parameter difference over every step: {worst:.2e} (torch's Muon runs "
              "Newton-Schulz in bf16, dmuond in fp32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DMuon in a Lightning `Trainer` with gradient clipping (gradient_clip_val):
`configure_optimizers` returns the DMuon. A tiny randomly initialised Llama
(examples/hf_trainer.py's) on random tokens, CPU, fp32.

    PYTHONPATH=client/python .venv/bin/python client/python/examples/lightning_trainer.py \
        [--steps 10] [--server auto|host:port] [--compare]

Lightning clips inside the closure it passes to optimizer.step(), after
backward's hooks handed the gradients to dmuond; DMuon's step() runs the
closure, sees that clipping changed them and has dmuond redo the step with
the clipped gradients (client/python/README.md, "Editing gradients after
backward()"). --compare runs torch.optim.Muon (fp32 Newton-Schulz) + AdamW
the same way and prints the largest difference.
"""

import argparse
import sys

import torch

import hf_trainer
from hf_trainer import MuonAdamW, RandomTokens, dmuon_for, tiny_llama


def run(steps, make_optimizer, clip=1.0):
    """Trains tiny_llama() for `steps` optimizer steps; returns every step's
    parameters (copies) and the optimizer."""
    import pytorch_lightning as pl

    seen = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()
            self.opt = None

        def training_step(self, batch, i):
            return self.model(**batch).loss

        def on_train_batch_end(self, outputs, batch, i):
            seen.append([p.detach().clone() for p in self.model.parameters()])

        def configure_optimizers(self):
            self.opt = make_optimizer(self.model)
            return self.opt

    pl.seed_everything(0, workers=True, verbose=False)
    module = Module()
    data = torch.utils.data.DataLoader(RandomTokens(), batch_size=8, shuffle=True,
                                       generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(max_steps=steps, gradient_clip_val=clip, accelerator="cpu",
                         devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True)
    try:
        trainer.fit(module, data)
    finally:
        if hasattr(module.opt, "close"):
            module.opt.close()
    return seen, module.opt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="training steps")
    ap.add_argument("--server", default="auto", help="auto or host:port of a dmuond")
    ap.add_argument("--compare", action="store_true",
                    help="also train with torch.optim.Muon (fp32 Newton-Schulz) + AdamW and "
                    "print the largest difference")
    a = ap.parse_args()
    dm, opt = run(a.steps, lambda m: dmuon_for(m, a.server))
    print(f"DMuon: {a.steps} steps; steps dmuond redid after clipping: "
          f"{opt.stats['redone_steps']}")
    if a.compare:
        ref, _ = run(a.steps, MuonAdamW)
        worst = max(((x - y).norm() / y.norm()).item()
                    for a_, b_ in zip(dm, ref) for x, y in zip(a_, b_))
        print(f"torch.optim.Muon + AdamW: largest relative parameter difference over "
              f"every step: {worst:.2e} (torch's Muon runs Newton-Schulz in bf16, "
              "dmuond in fp32)")
    return 0


assert hf_trainer  # the shared model, data and reference
if __name__ == "__main__":
    sys.exit(main())

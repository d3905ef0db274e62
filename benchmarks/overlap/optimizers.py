"""The optimizers `./dmuon bench overlap` compares, by name.

  adamw           torch.optim.AdamW on every parameter
  muon-bf16       torch.optim.Muon as shipped (bf16 Newton-Schulz) on the
                  blocks' matrices + torch.optim.AdamW on the rest
  muon-fp32       the same with torch's Newton-Schulz swapped for the same
                  iteration in fp32 (the client tests' oracle,
                  client/python/tests/torch_ref.py): the loss reference
  dmuon-off       DMuon, OverlapOptions(backward=False): gradients leave at step()
  dmuon           DMuon's default: each gradient leaves during backward
  dmuon-forward   DMuon, OverlapOptions(forward=True): step() returns at once,
                  each layer's forward waits for its own updates

Hyperparameters are the demo's (char_gpt.MUON, char_gpt.ADAMW); the head is
AdamW's in every Muon variant, as in the demo.
"""

from __future__ import annotations

import os
import sys

from models import ROOT, char_gpt
from ns_times import DMUON_METHOD  # the method the bound is timed with

LABELS = {
    "adamw": "AdamW",
    "muon-bf16": "torch.optim.Muon (bf16 NS, as shipped)",
    "muon-fp32": "torch.optim.Muon (fp32 NS)",
    "dmuon-off": "DMuon, overlap off",
    "dmuon": "DMuon, default (backward overlap)",
    "dmuon-forward": "DMuon, overlap_forward",
}
DMUON_KINDS = ("dmuon-off", "dmuon", "dmuon-forward")


def check_kinds(kinds: list[str]) -> list[str]:
    for k in kinds:
        if k not in LABELS:
            raise ValueError(f"--optimizers: unknown optimizer {k!r} (known: "
                             f"{', '.join(LABELS)})")
    return kinds


def _fp32_newton_schulz():
    sys.path.insert(0, os.path.join(ROOT, "client", "python", "tests"))
    from torch_ref import fp32_newton_schulz

    return fp32_newton_schulz


def make(kind: str, model, server: str | None = None):
    """The optimizer `kind` over `model` (a char_gpt.GPT); DMuon kinds talk
    to the dmuond at `server` (host:port)."""
    import torch

    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), **char_gpt.ADAMW)
    mats = model.matrices()
    ids = {id(p) for p in mats}
    others = [p for p in model.parameters() if id(p) not in ids]
    if kind in ("muon-bf16", "muon-fp32"):
        if kind == "muon-fp32":
            import torch.optim._muon as _muon

            _muon._zeropower_via_newtonschulz = _fp32_newton_schulz()
        return Pair(torch.optim.Muon(mats, **char_gpt.MUON),
                    torch.optim.AdamW(others, **char_gpt.ADAMW))
    if kind in DMUON_KINDS:
        from dmuon import AdamWOptions, DaemonOptions, OverlapOptions, RoutingOptions
        from dmuon.optim import DMuon

        if not server:
            raise ValueError(f"optimizer {kind}: needs the address of a dmuond")
        return DMuon(model, **char_gpt.MUON, method=DMUON_METHOD,
                     adamw_options=AdamWOptions(**char_gpt.ADAMW),
                     daemon_options=DaemonOptions(server),
                     routing_options=RoutingOptions(adamw=[model.head]),
                     overlap_options=OverlapOptions(backward=kind != "dmuon-off",
                                                    forward=kind == "dmuon-forward"))
    raise ValueError(f"unknown optimizer {kind!r}")


class Pair:
    """Two torch optimizers stepped as one (Muon's matrices, AdamW's rest)."""

    def __init__(self, *opts) -> None:
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

"""The models `./dmuon bench overlap` trains, and their data.

Every model is the demo's char-GPT (client/python/examples/char_gpt.py:
GPT, Block), built with other widths and depths, on the demo's corpus (a
text every Debian machine has). A point of the sweep is a model and a
number of tokens per step (batch x block); every optimizer of a point gets
the same initial weights (seed) and the same batches.
"""

from __future__ import annotations

import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# char_gpt (the model, the corpus, the demo's hyperparameters) and, through
# it, the dmuon package of this checkout.
sys.path.insert(0, os.path.join(ROOT, "client", "python", "examples"))

import char_gpt  # noqa: E402

BLOCK = 64  # context length; tokens per step = batch x BLOCK


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A char-GPT: `layers` blocks of width `d` with `heads` heads."""

    name: str
    d: int
    heads: int
    layers: int


# The demo's own char-GPT (char_gpt.GPT's defaults) and the GPTs.
MODELS = {
    "char-gpt": ModelSpec("char-gpt", d=128, heads=4, layers=4),
    "gpt-4l-384": ModelSpec("gpt-4l-384", d=384, heads=6, layers=4),
    "gpt-8l-384": ModelSpec("gpt-8l-384", d=384, heads=6, layers=8),
    "gpt-4l-512": ModelSpec("gpt-4l-512", d=512, heads=8, layers=4),
}


def model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"--models: unknown model {name!r} (known: {', '.join(MODELS)})")
    return MODELS[name]


def batch_size(tokens: int) -> int:
    """Sequences per step for `tokens` tokens per step (a multiple of BLOCK)."""
    if tokens < BLOCK or tokens % BLOCK:
        raise ValueError(f"--tokens: {tokens} is not a positive multiple of the "
                         f"context length {BLOCK}")
    return tokens // BLOCK


def build(spec: ModelSpec, corpus: char_gpt.Corpus, seed: int = 0) -> char_gpt.GPT:
    """The model with the seed's initial weights (the same for every optimizer)."""
    import torch

    torch.manual_seed(seed)
    return char_gpt.GPT(corpus.vocab, d=spec.d, heads=spec.heads, layers=spec.layers,
                        block=BLOCK)


def batches(corpus: char_gpt.Corpus, tokens: int, steps: int) -> list:
    """The (inputs, targets) of each step, made before any timing starts."""
    return [corpus.batch(s, batch=batch_size(tokens), block=BLOCK) for s in range(steps)]

"""Warnings about routes that are probably not what the user meant, given
once at construction (after routing, before anything is sent to dmuond):

- parameters given without their modules (``DMuon(model.parameters())``,
  ``named_parameters()``, decay/no-decay groups) are routed by shape, so an
  embedding or an output head goes through Newton-Schulz, which
  ``torch.optim.Muon``'s documentation advises against: the ones that look
  like one are named (by name when names are given, by shape otherwise),
  with how to pass the model;
- a parameter of more than 2 dims that no module says is a conv weight
  (given bare, or by ``muon=`` / ``use_muon=True``) is orthogonalized as one
  matrix flattened as a conv weight's (out x in*k): the one rule for every
  such parameter (through the model, a raw 3-D ``nn.Parameter`` goes to
  AdamW instead). If it is a stack of expert matrices, ``experts=`` treats
  each on its own.

Only the routes are read; nothing is changed.
"""

from __future__ import annotations

import warnings

from ._routing import Route

# Module names that hold an embedding or an output head in common models
# (GPT-2, Llama/torchtitan, BERT, T5, nanoGPT).
_EMBED_OR_HEAD = {
    "embed", "embeds", "embedding", "embeddings", "wte", "wpe", "tok_embeddings",
    "word_embeddings", "position_embeddings", "embed_tokens", "shared",
    "lm_head", "head", "output", "classifier", "score",
}
# By shape, without names: a vocabulary-sized dimension.
_VOCAB_ROWS = 8192


def _unmodeled(r: Route) -> bool:
    return r.route == "muon" and "no model=" in r.reason


def _looks_like_embedding_or_head(r: Route, named: bool) -> bool:
    if named:
        parts = r.name.split(".")
        module = parts[-2] if len(parts) >= 2 else parts[-1]
        return module in _EMBED_OR_HEAD or "embed" in module
    rows, cols = r.shape[0], r.shape[-1]
    return max(rows, cols) >= _VOCAB_ROWS and max(rows, cols) >= 4 * min(rows, cols)


def embeddings_and_heads(routes: list[Route], named: dict[int, str]) -> None:
    """Warns once naming the Muon parameters, routed by shape for want of a
    model, that look like an embedding or an output head."""
    suspects = [r for r in routes if _unmodeled(r)
                and _looks_like_embedding_or_head(r, id(r.param) in named)]
    if not suspects:
        return
    listed = ", ".join(f"{r.name} {list(r.shape)}" for r in suspects[:6])
    more = f" and {len(suspects) - 6} more" if len(suspects) > 6 else ""
    how = "its name" if id(suspects[0].param) in named else "its shape"
    warnings.warn(
        f"DMuon: the parameters came without their modules, so they are routed by "
        f"shape, and {listed}{more} (by {how}) look like an embedding or an output "
        "head, which go through Newton-Schulz here (torch.optim.Muon's "
        "documentation advises AdamW for them). Pass the model, DMuon(model, ...) or "
        "routing_options=RoutingOptions(model=model), to route embeddings by their "
        "modules, and RoutingOptions(adamw=[model.lm_head]) for the head; or route "
        "them yourself with RoutingOptions(adamw=[...]) or a group with "
        "use_muon=False", RuntimeWarning, stacklevel=5)


def flattened_stacks(routes: list[Route]) -> None:
    """Warns once naming the Muon parameters of more than 2 dims that no module
    says are conv weights (and are not expert stacks): each is one matrix."""
    stacks = [r for r in routes if r.route == "muon" and r.param.dim() > 2
              and not getattr(r, "parts", None) and "weight, flattened" not in r.reason]
    if not stacks:
        return
    listed = ", ".join(f"{r.name} {list(r.shape)} as {r.matrix[0]}x{r.matrix[1]}"
                       for r in stacks[:6])
    warnings.warn(
        f"DMuon: {listed} {'is' if len(stacks) == 1 else 'are'} orthogonalized as "
        "one matrix each, flattened as a conv weight (out x in*k): no module says "
        "what it is. If it is a stack of expert matrices [E, out, in], pass "
        "routing_options=RoutingOptions(experts=[...]) to orthogonalize each "
        "[out, in] on its own (through the model, a raw 3-D nn.Parameter goes to "
        "AdamW unless experts= names it)", RuntimeWarning, stacklevel=5)

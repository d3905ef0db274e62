"""The trainer's side of the critical-path bound: per-segment forward and
backward times of one step, measured with hooks on the trainer's cores.

The Muon matrices (model.matrices(), M of them, numbered 1..M in forward
order) cut the step into segments 0..M: forward segment k (k >= 1) runs from
matrix k's module's forward pre-hook to matrix k+1's (segment M: to the
start of backward, loss included), segment 0 from the step's start to
matrix 1's; backward segment k ends when matrix k's gradient is accumulated
(its post-accumulate-grad hook, as DMuon hands it off), segment M starting
with backward and segment 0 ending when backward returns. So, as the
simulation (bound.py) has it, segment k's gradient is ready at the end of its
backward and its update is needed at the start of its forward.

The optimizer is what every Muon trainer keeps in its own process: AdamW on
the non-Muon parameters after backward (with zero_grad and the loop:
"after_backward"), and each matrix's update applied (W <- W (1 - lr wd) -
lr' O, a fixed O here) in its module's forward pre-hook, so inside forward
segment k. Times are medians over the steps after warm-up.
"""

from __future__ import annotations

import math
import statistics
import time


def _segments(pre: list[float], grad: list[float], t_start: float, t_bwd: float,
              t_bwd_end: float) -> tuple[list[float], list[float]]:
    """One step's forward and backward segment times (module docstring) from
    its hook times: pre[k-1] / grad[k-1] for matrix k."""
    m = len(pre)
    fwd = [pre[0] - t_start] + [pre[k + 1] - pre[k] for k in range(m - 1)] + [t_bwd - pre[-1]]
    if any(grad[k] < grad[k + 1] for k in range(m - 1)):
        raise RuntimeError("layer_times: the gradients were not accumulated in reverse "
                           "forward order; the segment model does not fit this model")
    bwd = ([t_bwd_end - grad[0]] + [grad[k] - grad[k + 1] for k in range(m - 1)]
           + [grad[-1] - t_bwd])
    return fwd, bwd


def profile(model, batches, warmup: int) -> dict:
    """Trains `model` on `batches` as described above; returns the median
    segment times (seconds) and the median iteration (ms)."""
    import torch
    import trainer
    from models import char_gpt

    mats = model.matrices()
    ids = {id(p): i for i, p in enumerate(mats)}
    owner = {}
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if w is not None and id(w) in ids:
            owner[ids[id(w)]] = mod
    others = [p for p in model.parameters() if id(p) not in ids]
    adamw = torch.optim.AdamW(others, **char_gpt.ADAMW)
    lr, wd = char_gpt.MUON["lr"], char_gpt.MUON["weight_decay"]
    fixed = [torch.randn_like(p) / math.sqrt(max(p.shape)) for p in mats]
    pre_t: dict[int, float] = {}
    grad_t: dict[int, float] = {}

    def pre_hook(i):
        p, scale = mats[i], math.sqrt(max(1.0, mats[i].shape[0] / mats[i].shape[1]))

        def hook(module, inputs):
            pre_t[i] = time.perf_counter()
            with torch.no_grad():
                p.mul_(1 - lr * wd)
                p.add_(fixed[i], alpha=-lr * scale)
        return hook

    def grad_hook(i):
        def hook(p):
            grad_t[i] = time.perf_counter()
        return hook

    handles = [owner[i].register_forward_pre_hook(pre_hook(i)) for i in range(len(mats))]
    handles += [p.register_post_accumulate_grad_hook(grad_hook(i)) for i, p in enumerate(mats)]
    order: list[int] = []
    steps, usage = [], []
    try:
        for x, y in batches:
            pre_t.clear()
            grad_t.clear()
            t_start = time.perf_counter()
            usage.append(trainer.step_usage())
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                     y.view(-1))
            t_bwd = time.perf_counter()
            loss.backward()
            t_bwd_end = time.perf_counter()
            adamw.step()
            adamw.zero_grad(set_to_none=True)
            for p in mats:
                p.grad = None
            loss.item()
            if not order:
                order = sorted(pre_t, key=pre_t.get)
            steps.append((t_start, [pre_t[i] for i in order], [grad_t[i] for i in order],
                          t_bwd, t_bwd_end))
    finally:
        for h in handles:
            h.remove()
    rows = []
    for s in range(warmup, len(steps) - 1):
        t_start, pre, grad, t_bwd, t_bwd_end = steps[s]
        fwd, bwd = _segments(pre, grad, t_start, t_bwd, t_bwd_end)
        rows.append((fwd, bwd, steps[s + 1][0] - t_bwd_end, steps[s + 1][0] - t_start))
    med = statistics.median
    forward_s = [med(r[0][k] for r in rows) for k in range(len(mats) + 1)]
    backward_s = [med(r[1][k] for r in rows) for k in range(len(mats) + 1)]
    return {
        "forward_s": forward_s, "backward_s": backward_s,
        "after_backward_s": med(r[2] for r in rows),
        "iteration_ms": 1000 * med(r[3] for r in rows),
        "per_step": trainer.usage_per_step(usage, warmup),
        # Matrix k (forward order) as the simulation's task: its segment, shape.
        "matrices": [{"segment": k + 1, "shape": list(mats[i].shape),
                      "name": _name(model, mats[i])} for k, i in enumerate(order)],
    }


def _name(model, p) -> str:
    return next(n for n, q in model.named_parameters() if q is p)

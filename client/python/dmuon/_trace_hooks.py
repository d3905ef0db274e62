"""The model's side of the step timeline (dmuon/_trace.py), installed only
when DMUON_TRACE is set: the whole forward, the whole backward, and the
forward of each module that owns a Muon matrix, as spans of the trainer's
timeline.

The forward is the model's forward pre-hook to its forward hook. The
backward starts when autograd reaches the model's output (a hook on the
output tensor) and ends when autograd's engine finishes (a callback queued
from that hook, as DDP queues its own), so it spans the loss's backward
from the model's output down, with the matrices' ready and handoff events
inside it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from . import _wiring


def _first_tensor(out: Any) -> torch.Tensor | None:
    """The first tensor needing a gradient in a forward's output (a tensor,
    or tuples, lists and dicts of them; a ModelOutput is a dict)."""
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    items = out.values() if isinstance(out, dict) else out if isinstance(
        out, (tuple, list)) else ()
    for o in items:
        t = _first_tensor(o)
        if t is not None:
            return t
    return None


class TraceHooks:
    """The hooks on `module` that record its forward and backward in
    `tracer`; `step()` gives the step being built (its events' "step")."""

    def __init__(self, tracer, module: torch.nn.Module, muon_params, step) -> None:
        self.tracer, self.step = tracer, step
        self.handles: list[Any] = []
        self._starts: dict[int, list[int]] = {}
        self._backward_t0: int | None = None
        self._on(module, "forward")
        self.handles.append(module.register_forward_hook(self._root_end, prepend=True))
        names = {id(m): n for n, m in module.named_modules()}
        owned = {id(p) for p in muon_params}
        for m, params in _wiring._applied_in_forward_of(module):
            if m is not module and any(id(p) in owned for p in params):
                self._on(m, f"forward {names.get(id(m), type(m).__name__)}")

    def _on(self, m: torch.nn.Module, name: str) -> None:
        key = id(m)

        def pre(*_):
            self._starts.setdefault(key, []).append(time.monotonic_ns())

        def post(*_):
            stack = self._starts.get(key)
            if stack:
                self.tracer.complete(name, stack.pop(), time.monotonic_ns(),
                                     {"step": self.step()})
        self.handles.append(m.register_forward_pre_hook(pre))
        if name != "forward":  # the root's end is _root_end
            self.handles.append(m.register_forward_hook(post, prepend=True))
        else:
            self._root_post = post

    def _root_end(self, m, args, out):
        self._root_post()
        t = _first_tensor(out)
        if t is not None and torch.is_grad_enabled():
            t.register_hook(self._backward_start)

    def _backward_start(self, grad):
        if self._backward_t0 is None:
            self._backward_t0 = time.monotonic_ns()
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _backward_end(self):
        t0, self._backward_t0 = self._backward_t0, None
        if t0 is not None:
            self.tracer.complete("backward", t0, time.monotonic_ns(), {"step": self.step()})

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

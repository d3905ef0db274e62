"""DMuon's per-step gradient hand-off: each Muon gradient copied into the
session's buffers and declared ready (from backward's hooks, DDP's comm
hook, or step()), and each update waited for and applied, W <- W * (1 - lr
* wd) - lr * update.

_HandoffMixin is a part of DMuon (dmuon.optim), split out by concern; it
uses DMuon's attributes: _muon, _index (id(param) -> Muon index), _session,
_region (GPU transports), _grad/_upd (the session's buffers), the per-step
lists _handed/_applied/_received/_absent/_step_lr, _pending, _trained,
_accumulating, _ddp, _rank, _daemon, stats, synchronize().
"""

from __future__ import annotations

import time
import warnings

import torch

from . import _errors


class _HandoffMixin:
    """DMuon's per-step hand-off and apply (see the module docstring)."""

    def _reset_step(self):
        n = len(self._muon)
        self._handed, self._applied = [False] * n, [False] * n
        self._received = [False] * n  # nccl: update received
        self._absent = [False] * n  # no gradient this step: left unchanged
        self._step_lr = [(0.0, 0.0)] * n
        self._pending = False

    def _on_grad(self, i):
        if self._accumulating or (self._ddp is not None
                                  and not self._ddp.require_backward_grad_sync):
            return
        try:
            self._handoff(i, self._muon[i].param.grad)
        except Exception as e:  # noqa: BLE001 - raised by the next step()
            self._error = self._error or e

    def _handoff_flat(self, i, flat):
        try:
            self._handoff(i, flat)
        except Exception as e:  # noqa: BLE001 - raised by the next step()
            self._error = self._error or e

    def _check_shapes(self):
        for r in self._muon:
            if tuple(r.param.shape) != r.shape0:
                self._shape_error(r)

    @staticmethod
    def _shape_error(r):
        raise ValueError(
            f"DMuon: parameter {r.name} now has shape {list(r.param.shape)}; it was "
            f"registered with dmuond as {list(r.shape0)}. The parameter table is "
            "fixed when the optimizer is created: create a new DMuon (and "
            "load_state_dict) after changing a model's shapes")

    def _bucket_plan(self, params):
        """[(muon index or None, kind, offset, numel)] for a DDP bucket's
        parameters: "reduce" (all-reduce), "after" (all-reduce, then hand off),
        "local" (hand off at once, no all-reduce), "skip" (neither: step())."""
        plan, offset = [], 0
        for p in params:
            i = self._index.get(id(p))
            if i is None:
                kind = "reduce"
            elif self._muon[i].sharding == "replicated":
                kind = "after" if self._muon[i].handoff == "ddp" else "reduce"
            else:
                kind = "local" if self._muon[i].handoff == "ddp" else "skip"
            plan.append((i, kind, offset, p.numel()))
            offset += p.numel()
        return plan

    def _handoff(self, i, grad):
        if self._pending:
            self.synchronize()
        r = self._muon[i]
        if self._handed[i]:
            raise RuntimeError(
                f"DMuon: {r.name} got another gradient after it was handed to dmuond "
                f"for step {self._session.step}; with gradient accumulation, run "
                "every backward but the last micro-batch's inside "
                "`with optimizer.no_sync():` (or DDP's no_sync()), or use overlap=False")
        if tuple(r.param.shape) != r.shape0 or (grad is not None and grad.numel() !=
                                                 self._grad[i].numel()):
            self._shape_error(r)
        t0 = time.perf_counter()
        buf = self._grad[i]
        if grad is None:
            # The protocol has no "no gradient this step": dmuond gets zeros,
            # and _apply leaves the parameter unchanged (step()).
            self._absent[i] = True
            buf.zero_()
        elif not (r.sharding == "replicated" and self._rank != 0):
            buf.copy_(grad.detach().reshape(buf.shape))  # rank 0's is the one used
        if grad is not None:
            self._trained[i] = True
        if self._region is None:
            self._session.gradient_ready(i)
        else:
            # Hand-offs can come from several threads (autograd's, DDP's comm
            # hook callbacks); over nccl the daemon receives in declaration
            # order, so each send and its declaration go together.
            with self._handoff_lock:
                self._region.handed([i])  # cuda_ipc: event after the copy; nccl: send
                self._session.gradient_ready(i)
        self._handed[i] = True
        self.stats["handoff_seconds"] += time.perf_counter() - t0

    def _apply(self, i):
        if self._applied[i]:
            return
        r = self._muon[i]
        t0 = time.perf_counter()
        if self._region is not None and self._region.kind == "nccl":
            self._receive_until(i)
        self._session.wait_update(i)
        self._wait += time.perf_counter() - t0
        lr, wd = self._step_lr[i]
        p = r.param
        with torch.no_grad():
            if self._absent[i]:
                pass  # torch.optim.Muon: no decay, no update without a gradient
            elif self._session.skipped(i):
                warnings.warn(f"DMuon: dmuond skipped {r.name} at step "
                              f"{self._session.step} (non-finite gradient); "
                              "it is left unchanged", RuntimeWarning)
            else:
                u = self._upd[i]
                if p.device != u.device or p.dtype != u.dtype:
                    u = u.to(device=p.device, dtype=p.dtype)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(u.view(p.shape), alpha=-lr)
        self._applied[i] = True

    def _receive_until(self, i):
        """nccl: posts the update receives in the order dmuond announces them
        (one group per announcement) until update i's is posted; torch's
        stream orders the receive before the update is applied."""
        while not self._received[i]:
            ids = self._session.next_announced()
            if not ids:
                raise RuntimeError(f"DMuon: dmuond announced every update of step "
                                   f"{self._session.step} but not {self._muon[i].name}'s")
            self._region.receive(ids)
            for j in ids:
                self._received[j] = True

    def _apply_pending(self, ids):
        if self._pending:
            with _errors.explained(self._daemon):
                for i in ids:
                    self._apply(i)

    def _warn_absent(self, i):
        """A Muon matrix with momentum and no gradient in this step: the
        parameter is left unchanged, as torch.optim.Muon leaves it, but dmuond
        cannot be told "no gradient" (the protocol declares every parameter
        every step), so it gets zeros and its momentum decays (M <- mu * M),
        where torch's stays. Exact while the momentum is zero (a branch or a
        frozen parameter that has not trained yet)."""
        if i in self._warned_absent:
            return
        self._warned_absent.add(i)
        warnings.warn(
            f"DMuon: {self._muon[i].name} has no gradient in step {self._session.step}; "
            "it is left unchanged as torch.optim.Muon leaves it, but dmuond gets zeros "
            "for it, so its momentum decays by `momentum` where torch.optim.Muon's "
            "stays (the dmuond protocol cannot yet say 'no gradient'). Said once per "
            "parameter", RuntimeWarning, stacklevel=3)

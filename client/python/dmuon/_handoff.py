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

from . import _ddp, _dtensor, _errors, _parts, _routing
from ._recovery import deferred_sigint


class _HandoffMixin:
    """DMuon's per-step hand-off and apply (see the module docstring)."""

    def _reset_step(self):
        n = len(self._table.muon)
        self._handed, self._applied = [False] * n, [False] * n
        self._received = [False] * n  # nccl: update received
        self._absent = [False] * n  # no gradient this step: left unchanged
        self._step_lr = [(0.0, 0.0)] * n
        self._pending = False
        # (the .grad handed off, its _version then) per Muon index, None when
        # none was: step() checks those for edits (_edited_after_handoff).
        self._sent = [None] * n
        # The momentum each Muon index was handed off with (its group's then;
        # None: not handed off): step() redoes those changed since.
        self._sent_beta = [None] * n

    def _on_grad(self, i):
        if self._accumulating or (self._ddp is not None
                                  and not self._ddp.require_backward_grad_sync):
            return
        # The backwards that produced Muon gradients since the last step()
        # (_plan_next_handoff): one, and the next step hands off during
        # backward; several, and it hands off at step().
        self._grad_tasks.add(torch._C._current_graph_task_id())
        if self._defer_handoff:
            return  # handed off at step(), from .grad as it is then
        grad = _routing.grad(self._table.muon[i])  # a part's: its view
        if _dtensor.needs_collective(self._table.muon[i], grad):
            # A DTensor gradient not in its parameter's placements (Partial):
            # reduced and handed off at step(), in table order on every rank
            # (ranks could run these hooks in different orders).
            return
        try:
            self._handoff(i, grad)
        except Exception as e:  # noqa: BLE001 - raised by the next step()
            self._error = self._error or e

    def _handoff_flat(self, i, flat):
        try:
            self._handoff(i, flat)
        except Exception as e:  # noqa: BLE001 - raised by the next step()
            self._error = self._error or e

    def _check_shapes(self):
        for r in self._table.muon:
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
            i = self._table.index.get(id(p))
            if i is None:
                kind = "reduce"
            elif self._table.muon[i].sharding == "replicated":
                kind = "after" if self._table.muon[i].handoff == "ddp" else "reduce"
            else:
                kind = "local" if self._table.muon[i].handoff == "ddp" else "skip"
            plan.append((i, kind, offset, p.numel()))
            offset += p.numel()
        return _parts.bucket_plan(self._table, plan)  # a parameter with parts: each part's rows

    def _handoff(self, i, grad):
        self._recover(backward_only=True)  # an earlier backward died mid-way (_recovery)
        if self._pending:
            self.synchronize()
        self._track_backward()
        r = self._table.muon[i]
        if self._handed[i] and self._can_rewind():
            # A second backward before step(): a new .grad after a backward
            # whose step() was not taken (zero_grad() then backward, as when
            # GradScaler skips a step on inf/NaN), or the same .grad
            # accumulated (gradient accumulation, a second loss, a GAN's other
            # loss). dmuond's step of the first backward is undone (momentum
            # untouched) and the gradients are handed off again as they are
            # now; the rest of this step, and the next (_plan_next_handoff),
            # hand off at step(), so that such a loop rewinds once.
            self._defer_handoff = True
            self._rewind_step()
            return  # handed off at step(), from .grad as it is then
        if self._handed[i]:
            why = ("its tensors travel in GPU memory" if self._region is not None
                   else "it has no session")
            raise RuntimeError(
                f"DMuon: {r.name} got a second gradient for step {self._session.step} "
                "after the first was handed to dmuond during an earlier backward (a "
                "second backward before step(): gradient accumulation, a second loss, "
                "a backward whose step() was skipped, or zero_grad() then a new "
                "backward). dmuond can redo a step only on host buffers (shm, "
                f"inline), and {why}. Pass overlap=False (gradients then leave at "
                "step(), and every loop shape is exact), or run every backward but "
                "the last of a step inside `with optimizer.no_sync():` (DDP: "
                "model.no_sync())")
        grad = _dtensor.local_grad(r, grad)  # a DTensor's: its local rows (_dtensor)
        if tuple(r.param.shape) != r.shape0 or (grad is not None and grad.numel() !=
                                                 self._grad[i].numel()):
            self._shape_error(r)
        # This step's momentum when it is not the session's (a scheduler that
        # cycles it): sent with the declaration (protocol minor 2).
        beta = self._momentum_to_send(i)
        t0 = time.perf_counter()
        buf = self._grad[i]
        if grad is None:
            # torch.optim.Muon skips it: declared absent, dmuond computes
            # nothing and leaves its momentum as it is; _apply leaves the
            # parameter unchanged (no decay, no update).
            self._absent[i] = True
        elif not (r.sharding == "replicated" and self._rank != 0):
            buf.copy_(grad.detach().reshape(buf.shape))  # rank 0's is the one used
        if grad is not None:
            self._trained[i] = True
            self._sent[i] = (grad, grad._version)
        # Declared and recorded together: a Ctrl-C in between would leave
        # dmuond and _handed disagreeing (_recovery rolls back by _handed).
        with deferred_sigint():
            if grad is None:
                # No bytes on any transport (nccl: no send, and dmuond posts no
                # receive for it), so no place in the send order to keep.
                self._session.gradients_absent([i])
            elif self._region is None:
                self._declare_ready(i, beta)
            else:
                # Hand-offs can come from several threads (autograd's, DDP's
                # comm hook callbacks); over nccl the daemon receives in
                # declaration order, so each send and its declaration go
                # together.
                with self._handoff_lock:
                    self._region.handed([i])  # cuda_ipc: event after the copy; nccl: send
                    self._declare_ready(i, beta)
            self._handed[i] = True
            self._sent_beta[i] = float(self.param_groups[self._table.group_of[i]]["momentum"])
        self.stats["handoff_seconds"] += time.perf_counter() - t0

    def _declare_ready(self, i, beta):
        if beta is None:
            self._session.gradient_ready(i)
        else:
            self._session.gradients_ready([i], momentum=[beta])

    # ------------------------------------ gradients edited after their hand-off
    def _can_rewind(self):
        """Whether a step dmuond computed can be undone and redone here: host
        buffers (shm/inline; dmuond's CPU executors keep the pre-step momentum
        that a Rewind restores). With several ranks every rank rewinds (dmuond
        undoes the step once all have asked): step() agrees on it first
        (_agree_on_redo); a second backward does it on every rank alike."""
        return (self._region is None and self._session is not None
                and getattr(self._session, "rewind", None) is not None)

    def _edited_after_handoff(self):
        """The Muon indices whose .grad changed after it was handed off:
        clip_grad_norm_, GradScaler.unscale_, masking, a new .grad. Compared
        bit for bit with what dmuond got: the version counter does not do
        (GradScaler's unscale_ kernel changes the values without bumping it;
        clip_grad_norm_ bumps it even when it multiplies by exactly 1.0). One
        read of every handed-off gradient and its copy per step."""
        edited = []
        for i, rec in enumerate(self._sent):
            if rec is None or not self._handed[i] or self._absent[i]:
                continue
            if self._table.muon[i].sharding == "replicated" and self._rank != 0:
                # Only rank 0's copy is sent (its buffer here holds nothing of
                # this rank's); the gradient, and an edit of it, is every
                # rank's alike: rank 0 tells (_agree_on_redo).
                continue
            g = _routing.grad(self._table.muon[i])
            if _dtensor.needs_collective(self._table.muon[i], g):
                # A Partial DTensor gradient: reduced on its way to dmuond, at
                # this step(), just now (never from a hook): not comparable
                # with its local tensor, and nothing edited it since.
                continue
            g = _dtensor.local(g)
            buf = self._grad[i]
            if g is None or g.numel() != buf.numel() or not torch.equal(
                    g.detach().reshape(buf.shape).to(device=buf.device,
                                                      dtype=buf.dtype), buf):
                edited.append(i)
        return edited

    def _agree_on_redo(self, redo):
        """Several ranks, overlap=True: whether some rank must redo the step
        (an edit seen by any rank: rank 0 for replicated gradients, each rank
        for its own rows/unreduced ones). One all-reduce (MAX) of one int on
        DMuon's process group per step() (several ranks, overlap=True only);
        every rank then rewinds, or none (dmuond undoes a step of several
        ranks only when all ask)."""
        if self._world <= 1 or not self._overlap:
            # One rank; or overlap=False: every gradient leaves at step(),
            # after any edit, so nothing is redone and nothing disagrees. (Not
            # skipped when this step hands off at step() (_defer_handoff):
            # DDP's comm hook hands off during backward regardless.)
            return bool(redo)
        return _ddp.any_rank(bool(redo), self._pg)

    def _rewind_step(self):
        """Undoes dmuond's step in progress: every Muon gradient not handed
        off yet goes now (the step must complete), the step's updates are
        waited for and dropped, and dmuond puts the momentum back to before it
        (Rewind). The step is then built again: every gradient is handed off
        anew (_redo_step, or the backward in progress)."""
        t0 = time.perf_counter()
        for j, r in enumerate(self._table.muon):
            if not self._handed[j]:
                g = _routing.grad(r)
                # A Partial DTensor gradient would need a collective here, in
                # a backward hook (ranks could order them differently): it is
                # declared absent instead, on every rank alike (none hands it
                # from a hook); the step is undone anyway.
                self._handoff(j, None if _dtensor.needs_collective(r, g) else g)
        step_lr = self._step_lr
        with _errors.explained(self._daemon):
            self._session.finish_step()
            self._session.rewind()
        self._reset_step()
        self._step_lr = step_lr
        self.stats["rewound_steps"] = self.stats.get("rewound_steps", 0) + 1
        self._wait += time.perf_counter() - t0

    def _redo_step(self, edited):
        """step(): gradients edited after their hand-off (`edited`, Muon
        indices) are taken exactly as they are now: the step dmuond computed
        from the handed-off ones is rewound and every gradient handed off
        again. Without a rewind (several ranks, GPU transports) it raises
        naming the parameters."""
        names = (", ".join(self._table.muon[i].name for i in edited[:5])
                 if edited else "a Muon parameter (on another rank)")
        more = f" and {len(edited) - 5} more" if len(edited) > 5 else ""
        if not self._can_rewind():
            raise RuntimeError(
                f"DMuon: the gradient of {names}{more} changed after it was handed to "
                f"dmuond for step {self._session.step} (e.g. clip_grad_norm_, "
                "GradScaler.unscale_ or masking after backward()); with GPU "
                "transports dmuond cannot redo a step: pass overlap=False so that "
                "gradients leave at step(), after your edits")
        self._rewind_step()
        for j, r in enumerate(self._table.muon):
            self._handoff(j, _routing.grad(r))
        n = self.stats["redone_steps"] = self.stats.get("redone_steps", 0) + 1
        self._redo_streak = getattr(self, "_redo_streak", 0) + 1
        if self._redo_streak == 3 and not getattr(self, "_warned_redo", False):
            self._warned_redo = True
            warnings.warn(
                f"DMuon: Muon gradients were changed after backward() in 3 steps in a "
                f"row ({names}{more}; {n} so far), e.g. by gradient clipping that "
                "clips or GradScaler's unscale_; each such step is computed twice by "
                "dmuond (the second time not overlapped with backward). The numbers "
                "are exact either way; overlap=False computes each step once",
                RuntimeWarning, stacklevel=4)

    def _plan_next_handoff(self):
        """At a step's commit: the next step hands each gradient off during
        backward (overlapped with the rest of backward) when this one had a
        single backward producing Muon gradients; after several (gradient
        accumulation, two losses, a GAN's other loss, a skipped step) it hands
        them off at step(), as they are then, so that such loops cost no
        rewind (each computes a step twice) and stay exact."""
        self._defer_handoff = len(self._grad_tasks) > 1
        self._grad_tasks = set()

    def _apply(self, i):
        if self._applied[i]:
            return
        r = self._table.muon[i]
        if self._restage(i, _dtensor.local(_routing.param(r))):  # interrupted after staging
            return
        t0 = time.perf_counter()
        if self._region is not None and self._region.kind == "nccl":
            self._receive_until(i)
        self._session.wait_update(i)
        self._wait += time.perf_counter() - t0
        lr, wd = self._step_lr[i]
        p = _dtensor.local(_routing.param(r))  # a DTensor's local shard, a part's view
        with torch.no_grad():
            if self._absent[i] and self._session.absent(i):
                # No gradient on any rank (torch.optim.Muon: no decay, no
                # update). Absent here only, unreduced: dmuond averaged the
                # others' with zeros for this rank, as DDP's all-reduce with
                # find_unused_parameters gives every rank the averaged .grad,
                # and every rank applies the update below.
                pass
            elif self._session.skipped(i):
                warnings.warn(f"DMuon: dmuond skipped {r.name} at step "
                              f"{self._session.step} (non-finite gradient); "
                              "it is left unchanged", RuntimeWarning)
            else:
                u = self._upd[i]  # a DTensor's: its local shard (_dtensor)
                if p.device != u.device or p.dtype != u.dtype:
                    u = u.to(device=p.device, dtype=p.dtype)
                # torch.optim.Muon's p.mul_(1 - lr * wd); p.add_(u, alpha=-lr),
                # computed aside and copied in: an interrupt leaves p whole.
                new = p.mul(1 - lr * wd) if wd != 0 else p.clone()
                new.add_(u.view(p.shape), alpha=-lr)
                self._stage_apply(i, p, new)
                return
        self._applied[i] = True

    def _receive_until(self, i):
        """nccl: posts the update receives in the order dmuond announces them
        (one group per announcement) until update i's is posted; torch's
        stream orders the receive before the update is applied."""
        while not self._received[i]:
            if self._absent[i] and self._session.absent(i):
                return  # answered as absent: nothing to receive
            ids = self._session.next_announced()
            if not ids:
                if self._absent[i]:
                    return  # every update received; i's answer was "absent"
                raise RuntimeError(f"DMuon: dmuond announced every update of step "
                                   f"{self._session.step} but not {self._table.muon[i].name}'s")
            self._region.receive(ids)
            for j in ids:
                self._received[j] = True

    def _apply_pending(self, ids):
        if self._pending:
            with _errors.explained(self._daemon):
                for i in ids:
                    self._apply(i)

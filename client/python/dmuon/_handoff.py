"""DMuon's per-step hand-off (the Handoff object): each Muon gradient
copied into the session's buffers and declared ready (from backward's
hooks, DDP's comm hook, or step()), and each update waited for and applied,
W <- W * (1 - lr * wd) - lr * update.

A step's hand-off goes through these states (docs/design.md, "The Python
client"): idle -> handing off (on_grad: backward's hooks; at_step: the
rest) -> committed (commit(), after AdamW's step) -> applied (apply() of
each entry: synchronize(), or the next forward's pre-hooks) -> idle
(reset_step). A second backward before step() rewinds dmuond's step and
hands every gradient off again (rewind, redo); a step interrupted before
it commits is rolled back (dmuon/_recovery.py).

Handoff owns the per-step lists (handed, applied, received, absent,
step_lr, sent, sent_beta), the step stats, the session link
(dmuon/_session.py Link: the session, its buffers and region; `server`,
the daemon asked for, reopens it for a grown table), the lock that orders
GPU sends, its hooks (dmuon/_wiring.py Hooks, which reach it by a weak
reference; on `module`, the model) and the recovery (dmuon/_recovery.py).
It reads the MuonTable (dmuon/_table.py) and the optimizer's param_groups
(`groups`: DMuon relinks them after load_state_dict), runs the AdamW step
step() is given inside its commit, and never holds DMuon itself.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings

import numpy as np
import torch

from . import (_dcp, _ddp, _dtensor, _durability, _errors, _fallbacks, _groups, _native,
               _parts, _routing, _trace, _trace_hooks, _wiring)
from ._recovery import deferred_sigint


def same_bits(grad, buf):
    """Whether `grad`, as handed off (in buf's dtype and device), is bit for
    bit the copy `buf`. Bits, not values: torch.equal calls -0.0 equal to
    0.0 and a NaN unequal to itself. A CPU float32 gradient is compared in
    place with memcmp (_dmuon.same_bytes): about 2.5x faster than torch.equal,
    and the check reads every Muon gradient every step (issue 25)."""
    if _host_float32(grad) and _host_float32(buf):  # the common case, in fewest calls
        return _native.load().same_bytes(grad.detach().numpy(), buf.numpy())
    g = grad.detach().reshape(buf.shape)
    if (g.device.type == "cpu" and buf.device.type == "cpu" and g.dtype == buf.dtype
            and g.is_contiguous() and buf.is_contiguous()):
        return _native.load().same_bytes(g.numpy(), buf.numpy())
    g = g.to(device=buf.device, dtype=buf.dtype)
    as_int = _SAME_SIZE_INT[buf.element_size()]  # bits: an integer view
    return torch.equal(g.view(as_int), buf.view(as_int))


def _host_float32(t):
    """Whether `t` is a contiguous CPU float32 plain tensor, whose .numpy()
    is a view of it: Session.hand_off and same_bytes take it as it is.
    Anything else (a subclass, bf16, a GPU or strided gradient) goes
    through torch (copy_ into the buffer; a compare of integer views)."""
    return (type(t) is torch.Tensor and t.dtype is torch.float32 and t.is_cpu
            and t.is_contiguous())


# The integer dtype of each element size: same_bits compares those views.
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Handoff:
    """One DMuon's hand-off of Muon gradients and updates (see the module
    docstring)."""

    def __init__(self, table, groups, link, recovery, *, ddp, module, server, overlap,
                 overlap_forward, strict=False):
        self.table, self.groups, self.link, self.recovery = table, groups, link, recovery
        self.ddp, self.overlap, self.overlap_forward = ddp, overlap, bool(overlap_forward)
        # The model its hooks go on (DDP's module), or None; the daemon asked
        # for (DaemonOptions.server), where a grown table's first session opens.
        self.module, self.server = module, server
        self.pg, self.rank, self.world = link.pg, link.rank, link.world
        # DMuon.stats. wait: blocked on dmuond; handoff: copying gradients out
        # and declaring them (in backward's hooks, or in step()); redone /
        # rewound: steps dmuond computed again (gradients edited after their
        # hand-off, or a step() not taken); voided: rolled back.
        self.stats = {"steps": 0, "wait_seconds": 0.0, "last_wait_seconds": 0.0,
                      "last_step_seconds": 0.0, "handoff_seconds": 0.0,
                      "redone_steps": 0, "rewound_steps": 0}
        self.durability = _durability.Durability(self.stats)
        # stats["fallbacks"]; strict: raise instead (_fallbacks.py). The link
        # tells it of a private daemon and of host staging as it opens.
        self.fallbacks = _fallbacks.Fallbacks(self.stats, strict)
        link.fallback = self.fallbacks.take
        self.hooks = _wiring.Hooks(self)
        self.lock = threading.Lock()  # a GPU send and its declaration go together
        self.apply_update = _native.load().apply_update  # write()'s, looked up once
        self.accumulating = False  # no_sync()
        # Loop shape (plan_next_handoff): the backwards that gave Muon
        # gradients since the last step, and whether this step's gradients
        # are handed off at step() instead of during backward.
        self.grad_tasks, self.defer_handoff = set(), False
        self.wait = 0.0  # this step()'s seconds blocked on dmuond
        self.error = None  # a hook's hand-off error, raised by the next step()
        self.redo_streak, self.warned_redo = 0, False
        # Copies of a sub-mesh matrix: their gradients are compared once, at
        # the first step() (_dtensor.copies_differ).
        self.compare_copies = any(getattr(getattr(r, "dtensor", None), "copies", False)
                                  for r in table.routes)
        # Whether each entry's momentum may be non-zero (it had a gradient, or
        # a checkpoint was loaded): _dcp's test of a fresh optimizer.
        self.trained = [False] * len(table.muon)
        self.pending_step = None  # the session's step when it committed
        # The step timeline (dmuon/_trace.py Tracer; None: not tracing) and
        # its model hooks (dmuon/_trace_hooks.py), set by open().
        self.trace, self.trace_hooks = None, None
        self.reset_step()

    def reset_step(self):
        n = len(self.table.muon)
        self.handed, self.applied = [False] * n, [False] * n
        self.received = [False] * n  # nccl: update received
        self.absent = [False] * n  # no gradient this step: left unchanged
        self.step_lr = [(0.0, 0.0)] * n
        self.pending = False
        # (the .grad handed off, its _version then) per Muon index, None when
        # none was: step() checks those for edits (edited_after_handoff).
        self.sent = [None] * n
        # The momentum each Muon index was handed off with (its group's then;
        # None: not handed off): step() redoes those changed since.
        self.sent_beta = [None] * n

    def on_grad(self, i):
        if self.accumulating or (self.ddp is not None
                                  and not self.ddp.require_backward_grad_sync):
            return
        if self.trace is not None:
            self.trace.instant(f"ready {self.table.muon[i].name}", time.monotonic_ns(),
                               self.trace_args(i, "ready"))
        # The backwards that produced Muon gradients since the last step()
        # (plan_next_handoff): one, and the next step hands off during
        # backward; several, and it hands off at step().
        self.grad_tasks.add(torch._C._current_graph_task_id())
        if self.defer_handoff:
            return  # handed off at step(), from .grad as it is then
        grad = _routing.grad(self.table.muon[i])  # a part's: its view
        if _dtensor.needs_collective(self.table.muon[i], grad):
            # A DTensor gradient not in its parameter's placements (Partial):
            # reduced and handed off at step(), in table order on every rank
            # (ranks could run these hooks in different orders).
            return
        try:
            self.hand_off(i, grad)
        except Exception as e:  # noqa: BLE001 - raised by the next step()
            self.error = self.error or e

    def handoff_flat(self, i, flat):
        try:
            self.hand_off(i, flat)
        except Exception as e:  # noqa: BLE001 - raised by the next step()
            self.error = self.error or e

    def check_shapes(self):
        for r in self.table.muon:
            if tuple(r.param.shape) != r.shape0:
                self.shape_error(r)

    @staticmethod
    def shape_error(r):
        raise ValueError(
            f"DMuon: parameter {r.name} now has shape {list(r.param.shape)}; it was "
            f"registered with dmuond as {list(r.shape0)}. The parameter table is "
            "fixed when the optimizer is created: create a new DMuon (and "
            "load_state_dict) after changing a model's shapes")

    def bucket_plan(self, params):
        """[(muon index or None, kind, offset, numel)] for a DDP bucket's
        parameters: "reduce" (all-reduce), "after" (all-reduce, then hand off),
        "local" (hand off at once, no all-reduce), "skip" (neither: step())."""
        plan, offset = [], 0
        for p in params:
            i = self.table.index.get(id(p))
            if i is None:
                kind = "reduce"
            elif self.table.muon[i].sharding == "replicated":
                kind = "after" if self.table.muon[i].handoff == "ddp" else "reduce"
            else:
                kind = "local" if self.table.muon[i].handoff == "ddp" else "skip"
            plan.append((i, kind, offset, p.numel()))
            offset += p.numel()
        return _parts.bucket_plan(self.table, plan)  # a parameter with parts: each part's rows

    def hand_off(self, i, grad):
        # An earlier backward that died mid-way is rolled back (_recovery):
        # looked for at each backward's first hand-off.
        first = not self.recovery.tracked()
        if first:
            self.recovery.recover(self, backward_only=True)
        if self.pending:
            self.synchronize()
        if first:
            self.recovery.track_backward()
        r = self.table.muon[i]
        if self.handed[i] and self.can_rewind():
            # A second backward before step(): a new .grad after a backward
            # whose step() was not taken (zero_grad() then backward, as when
            # GradScaler skips a step on inf/NaN), or the same .grad
            # accumulated (gradient accumulation, a second loss, a GAN's other
            # loss). dmuond's step of the first backward is undone (momentum
            # untouched) and the gradients are handed off again as they are
            # now; the rest of this step, and the next (plan_next_handoff),
            # hand off at step(), so that such a loop rewinds once.
            self.fallbacks.take(
                "rewind", f"{r.name} got a second gradient for step "
                f"{self.link.session.step} after the first was handed to dmuond (a "
                "second backward before step()): dmuond's step is rewound and "
                "computed again from the gradients at step()")
            self.defer_handoff = True
            self.rewind()
            return  # handed off at step(), from .grad as it is then
        if self.handed[i]:
            why = ("its tensors travel in GPU memory" if self.link.region is not None
                   else "it has no session")
            raise RuntimeError(
                f"DMuon: {r.name} got a second gradient for step {self.link.session.step} "
                "after the first was handed to dmuond during an earlier backward (a "
                "second backward before step(): gradient accumulation, a second loss, "
                "a backward whose step() was skipped, or zero_grad() then a new "
                "backward). dmuond can redo a step only on host buffers (shm, "
                f"inline), and {why}. Pass overlap_options=OverlapOptions(backward="
                "False) (gradients then leave at step(), and every loop shape is "
                "exact), or run every backward but "
                "the last of a step inside `with optimizer.no_sync():` (DDP: "
                "model.no_sync())")
        grad = _dtensor.local_grad(r, grad)  # a DTensor's: its local rows (_dtensor)
        if r.param.shape != r.shape0 or (grad is not None and grad.numel() !=
                                                 self.link.grad[i].numel()):
            self.shape_error(r)
        # This step's momentum when it is not the session's (a scheduler that
        # cycles it): sent with the declaration (protocol minor 2).
        beta = self.momentum_to_send(i)
        t0, t0_ns = time.perf_counter(), time.monotonic_ns()
        copy = grad is not None and not (r.sharding == "replicated" and self.rank != 0)
        host = copy and self.link.region is None and _host_float32(grad)
        if grad is None:
            # torch.optim.Muon skips it: declared absent, dmuond computes
            # nothing and leaves its momentum as it is; apply() leaves the
            # parameter unchanged (no decay, no update).
            self.absent[i] = True
        elif copy and not host:
            buf = self.link.grad[i]
            buf.copy_(grad.detach().reshape(buf.shape))  # rank 0's is the one used
        if grad is not None:
            self.trained[i] = True
            self.sent[i] = (grad, grad._version)
        # Set before the declaration: read only for entries marked handed.
        self.sent_beta[i] = float(self.groups[self.table.group_of[i]]["momentum"])
        sent_ns = self._declare(i, grad, beta, host)
        self.stats["handoff_seconds"] += time.perf_counter() - t0
        if self.trace is not None:
            # The copy, then the declaration (the gRPC write of
            # GradientsReady): dmuond's "received" follows the latter's start.
            args = self.trace_args(i, "handoff")
            args["absent"] = int(grad is None)
            self.trace.complete(f"handoff {r.name}", t0_ns, sent_ns, args)
            self.trace.complete(f"declare {r.name}", sent_ns, time.monotonic_ns(),
                                self.trace_args(i, "declare"))

    def _declare(self, i, grad, beta, host):
        """Declares entry i's gradient (`host`: also copies it in), or its
        absence (grad None), and marks it handed; returns when the copy was
        done (the timeline's handoff/declare boundary). Declared and marked
        together: a Ctrl-C in between would leave dmuond and `handed`
        disagreeing (_recovery rolls back by `handed`)."""
        if host:
            # A CPU float32 gradient: copied, declared and marked by one
            # native call, inside which no Python code runs to take a Ctrl-C
            # (issue 25: torch's copy_, a second call into the client and
            # deferred_sigint's handler swaps cost about 60 µs a matrix more
            # between backward's kernels).
            return self.link.session.hand_off(i, grad.detach().numpy(), beta, self.handed)
        sent_ns = time.monotonic_ns()
        with deferred_sigint():
            if grad is None:
                # No bytes on any transport (nccl: no send, and dmuond posts no
                # receive for it), so no place in the send order to keep.
                self.link.session.gradients_absent([i])
            elif self.link.region is None:
                self._declare_ready(i, beta)
            else:
                # Hand-offs can come from several threads (autograd's, DDP's
                # comm hook callbacks); over nccl the daemon receives in
                # declaration order, so each send and its declaration go
                # together.
                with self.lock:
                    self.link.region.handed([i])  # cuda_ipc: event after the copy; nccl: send
                    self._declare_ready(i, beta)
            self.handed[i] = True
        return sent_ns

    def trace_args(self, i, stage):
        """The args of entry i's timeline events (dmuon/_trace.py): what the
        daemon's carry too, so the merge links them."""
        r = self.table.muon[i]
        rows, cols = r.matrix
        return {"stage": stage, "job": self.link.job_id, "step": self.link.session.step,
                "param": i, "name": r.name, "shape": f"{rows}x{cols}"}

    def trace_apply(self, i, t0_ns, waited_ns):
        """Entry i's wait (t0_ns to waited_ns), when the client saw its update
        (Session::update_received_ns) and its apply (to now)."""
        name = self.table.muon[i].name
        self.trace.complete(f"wait {name}", t0_ns, waited_ns, self.trace_args(i, "wait"))
        got = self.link.session.update_received_ns(i)
        if got:
            self.trace.instant(f"update_received {name}", got,
                               self.trace_args(i, "update_received"))
        self.trace.complete(f"apply {name}", waited_ns, time.monotonic_ns(),
                            self.trace_args(i, "apply"))
    def _declare_ready(self, i, beta):
        if beta is None:
            self.link.session.gradient_ready(i)
        else:
            self.link.session.gradients_ready([i], momentum=[beta])

    # ------------------------------------ gradients edited after their hand-off
    def can_rewind(self):
        """Whether a step dmuond computed can be undone and redone here: host
        buffers (shm/inline; dmuond's CPU executors keep the pre-step momentum
        that a Rewind restores). With several ranks every rank rewinds (dmuond
        undoes the step once all have asked): step() agrees on it first
        (agree_on_redo); a second backward does it on every rank alike."""
        return (self.link.region is None and self.link.session is not None
                and getattr(self.link.session, "rewind", None) is not None)

    def edited_after_handoff(self):
        """The Muon indices whose .grad changed after it was handed off:
        clip_grad_norm_, GradScaler.unscale_, masking, a new .grad. Compared
        bit for bit with what dmuond got: the version counter does not do
        (GradScaler's unscale_ kernel changes the values without bumping it;
        clip_grad_norm_ bumps it even when it multiplies by exactly 1.0). One
        read of every handed-off gradient and its copy per step."""
        edited = []
        for i, rec in enumerate(self.sent):
            if rec is None or not self.handed[i] or self.absent[i]:
                continue
            if self.table.muon[i].sharding == "replicated" and self.rank != 0:
                # Only rank 0's copy is sent (its buffer here holds nothing of
                # this rank's); the gradient, and an edit of it, is every
                # rank's alike: rank 0 tells (agree_on_redo).
                continue
            g = _routing.grad(self.table.muon[i])
            if _dtensor.needs_collective(self.table.muon[i], g):
                # A Partial DTensor gradient: reduced on its way to dmuond, at
                # this step(), just now (never from a hook): not comparable
                # with its local tensor, and nothing edited it since.
                continue
            g = _dtensor.local(g)
            buf = self.link.grad[i]
            if g is None or g.numel() != buf.numel() or not same_bits(g, buf):
                edited.append(i)
        return edited

    def agree_on_redo(self, redo):
        """Several ranks, overlap=True: whether some rank must redo the step
        (an edit seen by any rank: rank 0 for replicated gradients, each rank
        for its own rows/unreduced ones). One all-reduce (MAX) of one int on
        DMuon's process group per step() (several ranks, overlap=True only);
        every rank then rewinds, or none (dmuond undoes a step of several
        ranks only when all ask)."""
        if self.world <= 1 or not self.overlap:
            # One rank; or overlap=False: every gradient leaves at step(),
            # after any edit, so nothing is redone and nothing disagrees. (Not
            # skipped when this step hands off at step() (_defer_handoff):
            # DDP's comm hook hands off during backward regardless.)
            return bool(redo)
        return _ddp.any_rank(bool(redo), self.pg)

    def rewind(self):
        """Undoes dmuond's step in progress: every Muon gradient not handed
        off yet goes now (the step must complete), the step's updates are
        waited for and dropped, and dmuond puts the momentum back to before it
        (Rewind). The step is then built again: every gradient is handed off
        anew (redo(), or the backward in progress)."""
        t0 = time.perf_counter()
        for j, r in enumerate(self.table.muon):
            if not self.handed[j]:
                g = _routing.grad(r)
                # A Partial DTensor gradient would need a collective here, in
                # a backward hook (ranks could order them differently): it is
                # declared absent instead, on every rank alike (none hands it
                # from a hook); the step is undone anyway.
                self.hand_off(j, None if _dtensor.needs_collective(r, g) else g)
        step_lr = self.step_lr
        with _errors.explained(self.link):
            self.link.session.finish_step()
            self.link.session.rewind()
        self.reset_step()
        self.step_lr = step_lr
        self.stats["rewound_steps"] = self.stats.get("rewound_steps", 0) + 1
        self.wait += time.perf_counter() - t0

    def redo(self, edited):
        """step(): gradients edited after their hand-off (`edited`, Muon
        indices) are taken exactly as they are now: the step dmuond computed
        from the handed-off ones is rewound and every gradient handed off
        again. Without a rewind (several ranks, GPU transports) it raises
        naming the parameters."""
        names = (", ".join(self.table.muon[i].name for i in edited[:5])
                 if edited else "a Muon parameter (on another rank)")
        more = f" and {len(edited) - 5} more" if len(edited) > 5 else ""
        if not self.can_rewind():
            raise RuntimeError(
                f"DMuon: the gradient of {names}{more} changed after it was handed to "
                f"dmuond for step {self.link.session.step} (e.g. clip_grad_norm_, "
                "GradScaler.unscale_ or masking after backward()); with GPU "
                "transports dmuond cannot redo a step: pass overlap_options="
                "OverlapOptions(backward=False) so that gradients leave at step(), "
                "after your edits")
        self.fallbacks.take(
            "redo", f"the gradient (or momentum) of {names}{more} changed after it "
            f"was handed to dmuond for step {self.link.session.step}: dmuond's step "
            "is rewound and computed again, not overlapped with backward")
        self.rewind()
        for j, r in enumerate(self.table.muon):
            self.hand_off(j, _routing.grad(r))
        n = self.stats["redone_steps"] = self.stats.get("redone_steps", 0) + 1
        self.redo_streak += 1
        if self.redo_streak == 3 and not self.warned_redo:
            self.warned_redo = True
            warnings.warn(
                f"DMuon: Muon gradients were changed after backward() in 3 steps in a "
                f"row ({names}{more}; {n} so far), e.g. by gradient clipping that "
                "clips or GradScaler's unscale_; each such step is computed twice by "
                "dmuond (the second time not overlapped with backward). The numbers "
                "are exact either way; overlap_options=OverlapOptions(backward=False) "
                "computes each step once",
                RuntimeWarning, stacklevel=5)

    def plan_next_handoff(self):
        """At a step's commit: the next step hands each gradient off during
        backward (overlapped with the rest of backward) when this one had a
        single backward producing Muon gradients; after several (gradient
        accumulation, two losses, a GAN's other loss, a skipped step) it hands
        them off at step(), as they are then, so that such loops cost no
        rewind (each computes a step twice) and stay exact."""
        self.defer_handoff = len(self.grad_tasks) > 1
        self.grad_tasks = set()

    def apply(self, i):
        if self.applied[i]:
            return
        r = self.table.muon[i]
        t0, t0_ns = time.perf_counter(), time.monotonic_ns()
        if self.link.region is not None and self.link.region.kind == "nccl":
            self._receive_until(i)
        self.link.session.wait_update(i)
        self.wait += time.perf_counter() - t0
        waited_ns = time.monotonic_ns()
        lr, wd = self.step_lr[i]
        p = _dtensor.local(_routing.param(r))  # a DTensor's local shard, a part's view
        if self.absent[i] and self.link.session.absent(i):
            # No gradient on any rank (torch.optim.Muon: no decay, no
            # update). Absent here only, unreduced: dmuond averaged the
            # others' with zeros for this rank, as DDP's all-reduce with
            # find_unused_parameters gives every rank the averaged .grad,
            # and every rank applies the update below.
            pass
        elif self.link.session.skipped(i):
            warnings.warn(f"DMuon: dmuond skipped {r.name} at step "
                          f"{self.link.session.step} (non-finite gradient); "
                          "it is left unchanged", RuntimeWarning)
        else:
            u = self.link.upd[i]  # a DTensor's: its local shard (_dtensor)
            if p.device != u.device or p.dtype != u.dtype:
                u = u.to(device=p.device, dtype=p.dtype)
            self.write(i, p, u.view(p.shape), lr, wd)
            if self.trace is not None:
                self.trace_apply(i, t0_ns, waited_ns)
            return
        self.applied[i] = True
        if self.trace is not None:
            self.trace_apply(i, t0_ns, waited_ns)

    def _receive_until(self, i):
        """nccl: posts the update receives in the order dmuond announces them
        (one group per announcement) until update i's is posted; torch's
        stream orders the receive before the update is applied."""
        while not self.received[i]:
            if self.absent[i] and self.link.session.absent(i):
                return  # answered as absent: nothing to receive
            ids = self.link.session.next_announced()
            if not ids:
                if self.absent[i]:
                    return  # every update received; i's answer was "absent"
                raise RuntimeError(f"DMuon: dmuond announced every update of step "
                                   f"{self.link.session.step} but not "
                                   f"{self.table.muon[i].name}'s")
            self.link.region.receive(ids)
            for j in ids:
                self.received[j] = True

    def apply_pending(self, ids):
        if self.pending:
            with _errors.explained(self.link):
                for i in ids:
                    self.apply(i)

    def synchronize(self):
        """Applies every outstanding update of the last step (overlap_forward;
        or of a step() that an interrupt cut short after it committed)."""
        if not self.pending:
            self.recovery.recover(self)  # a step interrupted before it committed
            return
        with _errors.explained(self.link):
            for i in range(len(self.table.muon)):
                self.apply(i)
            if self.link.session.step == self.pending_step:  # not if it ran, then an interrupt
                self.link.session.finish_step()
                self.durability.completed(self.link.session)
        self.reset_step()

    def write(self, i, p, u, lr, wd):
        """torch.optim.Muon's update of entry i's parameter p, in place and
        in its order (p.mul_(1 - lr * wd); p.add_(u, alpha=-lr): the same
        bits), and i marked applied, whole: a Ctrl-C inside lands before it
        or after it, so an interrupt leaves p either untouched or updated
        and marked, never half-way, and a retry never applies it twice.
        Plain tensors with no torch function or dispatch mode active: one
        native call (_dmuon.apply_update) on p detached (no grad-mode
        switch; p's version counter still moves), inside which no Python
        code runs that could take the interrupt (but a garbage collection's
        __del__, whose KeyboardInterrupt Python reports and drops); anything
        else (a tensor subclass, a mode, whose Python code could take it)
        under deferred_sigint (write_deferred).
        In place: computing the new value aside and copying it in cost an
        allocation and two more passes over every matrix, about 8 ms a step
        of the 4-layer d=384 GPT on one core (issue 25)."""
        decay = 1 - lr * wd if wd != 0 else None
        pd = p.detach()
        if (type(pd) is torch.Tensor and type(u) is torch.Tensor
                and not torch._C._len_torch_function_stack()
                and not torch._C._len_torch_dispatch_stack()):
            self.apply_update(pd, u, decay, -lr, self.applied, i)
        else:
            self.write_deferred(p, u, decay, -lr, self.applied, i)

    @staticmethod
    def write_deferred(p, u, decay, alpha, applied, i):
        """apply_update's steps in Python, on p itself under no_grad (a
        subclass's own in-place ops, whatever its detach() gives), whole by
        deferred_sigint: for what runs Python code inside (write())."""
        with torch.no_grad(), deferred_sigint():
            if decay is not None:
                p.mul_(decay)
            p.add_(u, alpha=alpha)
            applied[i] = True

    # ------------------------------------------------------------ momentum
    def momentum_to_send(self, i):
        """This step's momentum (beta) for entry i, sent with its hand-off
        (GradientsReady.momentum, protocol minor 2), or None: its group's
        'momentum' is the one the dmuond session was opened with and no
        scheduler cycles it. OneCycleLR/CyclicLR with cycle_momentum=True set
        each group's 'momentum' every step (and mark the groups with
        'base_momentum'/'max_momentum'), as torch.optim.Muon reads it."""
        g = self.table.group_of[i]
        group = self.groups[g]
        beta = float(group["momentum"])
        if not 0.0 <= beta < 1.0:  # NaN too
            raise ValueError(f"DMuon: param_groups[{g}]['momentum'] is "
                             f"{group['momentum']!r}; it must be in [0, 1)")
        if (beta == self.table.momentum.get(g) and "max_momentum" not in group
                and "base_momentum" not in group):
            return None
        return beta

    def momentum_moved(self):
        """step(): the entries handed off with another momentum than their
        group's now (a scheduler, or the user, changed it after the hand-off,
        during or after backward). With a rewind they are redone (exact);
        otherwise it raises naming the group."""
        moved = []
        for i, beta in enumerate(self.sent_beta):
            if beta is None or not self.handed[i] or self.absent[i]:
                continue
            g = self.table.group_of[i]
            if float(self.groups[g]["momentum"]) != beta:
                moved.append(i)
        if moved and not self.can_rewind():
            g = self.table.group_of[moved[0]]
            raise RuntimeError(
                f"DMuon: param_groups[{g}]['momentum'] changed from "
                f"{self.sent_beta[moved[0]]!r} to {self.groups[g]['momentum']!r} after "
                f"the gradient of {self.table.muon[moved[0]].name} was handed to dmuond "
                f"for step {self.link.session.step}; with GPU transports dmuond "
                "cannot redo a step: change the momentum (scheduler.step()) after "
                "optimizer.step() and before the next backward, or pass overlap_options="
                "OverlapOptions(backward=False) so that gradients leave at step()")
        return moved

    def check_hyperparameters(self):
        """What the daemon was given must not have changed (lr and weight_decay
        are applied here and may change, and momentum goes to dmuond with each
        step's hand-offs: momentum_to_send; equal values in another spelling,
        e.g. a list for a tuple or "original" for None, are fine)."""
        changed = self.table.changed(_groups.specs(self.groups, self.table.group_of))
        if changed is None:
            return
        g, name, then, now = changed
        if name is None:
            raise ValueError(f"DMuon: param_groups[{g}]['momentum'] is "
                             f"{self.groups[g]['momentum']!r}; it must be in [0, 1)")
        raise ValueError(
            f"DMuon: param_groups[{g}]['{name}'] changed from {then!r} to {now!r}; "
            "dmuond fixes every Muon hyperparameter but lr, weight_decay and momentum "
            "when the optimizer is created: create a new DMuon and load_state_dict() "
            "into it")

    # ---------------------------------------------------------- boundaries
    def before_forward(self, *args):
        """The model's forward pre-hook: a step interrupted before it
        committed is rolled back, one that committed is completed (its
        updates must be in before this forward uses the parameters)."""
        self.recovery.recover(self)
        if self.pending and not self.overlap_forward:
            self.synchronize()
        self.check_shapes()

    def settle(self):
        """zero_grad(): rolls back an interrupted step that had not committed
        (it still reads .grad) and completes one that had. A dead private
        dmuond is not an error here, as torch's zero_grad does not fail:
        nothing can complete the step, its error was raised where it
        happened, and state_dict() repeats it with what to do."""
        try:
            self.recovery.recover(self)
            if self.pending and not self.overlap_forward:
                self.synchronize()
        except _native.load().Error:
            daemon = self.link.daemon
            if daemon is None or daemon.alive():
                raise

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside hand nothing to dmuond (DMuon.no_sync)."""
        old, self.accumulating = self.accumulating, True
        try:
            yield
        finally:
            self.accumulating = old

    @contextlib.contextmanager
    def timed_step(self):
        """One step()'s stats: its seconds, those blocked on dmuond (wait),
        and the step count, once it returned."""
        t0, self.wait = time.perf_counter(), 0.0
        t0_ns = time.monotonic_ns()
        step = self.link.session.step if self.link.session is not None else None
        yield
        if self.trace is not None:
            self.trace.complete("step()", t0_ns, time.monotonic_ns(), {"step": step})
        self.stats["steps"] += 1
        self.stats["last_wait_seconds"] = self.wait
        self.stats["wait_seconds"] += self.wait
        self.stats["last_step_seconds"] = time.perf_counter() - t0

    def at_boundary(self, what):
        """Between steps only: applies what is outstanding, and raises if
        gradients of the next step are with dmuond already."""
        self.synchronize()
        if self.link.session is not None and any(self.handed):
            raise RuntimeError(f"DMuon.{what}() in the middle of a step (gradients are "
                               "already with dmuond): call it after step()")

    # ----------------------------------------------------------------- step
    def at_step(self):
        """step() up to its commit: every Muon gradient not handed off yet is
        handed off now, and one edited after its hand-off (or handed off with
        another momentum) is handed off again. False for
        torch.distributed.checkpoint's init step (dmuon/_dcp.py), which is
        AdamW's alone."""
        session = self.link.session
        if self.compare_copies and session is not None and not _dcp.is_init_step(self):
            # First, on every rank (a collective), even one about to raise
            # its own error below.
            self.compare_copies = False
            differ = _dtensor.copies_differ(self.table.muon, self.pg, self.world)
            if differ:
                # A model error, on every rank alike: no step is taken, now or
                # later (the recovery raises it again).
                self.recovery.lost = RuntimeError(
                    f"{differ}. No step was taken; fix the model or the routing "
                    "and create the optimizer again")
                raise self.recovery.lost
        if self.error is not None:
            err, self.error = self.error, None
            # The step fails before it commits: rolled back (_recovery), so
            # the next backward and step() start clean.
            self.recovery.void_step(
                self, f"a gradient hand-off failed: {type(err).__name__}",
                cause=err if isinstance(err, _native.load().Error) else None)
            raise err
        if session is None:
            return True
        if _dcp.is_init_step(self):
            return False
        self.synchronize()  # a step() right after a step(), without backward
        try:
            self.check_hyperparameters()
        except ValueError:
            self.recovery.void_step(self, "a hyperparameter dmuond fixes was changed")
            raise
        self.recovery.stepping = True  # until it commits: an interrupt rolls it back
        for i, r in enumerate(self.table.muon):
            if r.handoff == "step (frozen)" and r.param.requires_grad:
                self.hooks.grad(i, r)  # unfrozen: hooked from the next backward
            g = self.groups[self.table.group_of[i]]
            self.step_lr[i] = (float(g["lr"]), float(g["weight_decay"]))
            if not self.handed[i]:
                self.hand_off(i, _routing.grad(r))
        # Gradients edited after their hand-off (clipping, unscaling,
        # masking) are taken as they are now: exact, at the cost of
        # computing the step again (client/python/README.md).
        t0_ns = time.monotonic_ns()
        edited = self.edited_after_handoff()
        if self.trace is not None:
            self.trace.complete("check edits", t0_ns, time.monotonic_ns(),
                                {"step": session.step})
        # So is a momentum changed after its gradients' hand-off (a
        # scheduler stepped between backward and step()): redone with it.
        moved = self.momentum_moved()
        # Several ranks: all redo, or none (one tiny all-reduce).
        if self.agree_on_redo(edited or moved):
            self.redo(sorted(set(edited) | set(moved)))
        else:
            self.redo_streak = 0
        return True

    def step(self, adamw_step):
        """step(): the hand-off up to its commit (at_step), AdamW's step
        (adamw_step(), run while dmuond computes) and the commit, whole (a
        Ctrl-C in them is raised after the commit: the step is then
        completed, not undone), then its updates applied (after_commit).
        torch.distributed.checkpoint's init step (zero gradients, lr 0:
        dmuon/_dcp.py) is AdamW's alone, no dmuond step."""
        if not self.at_step():
            adamw_step()
            return
        _groups.adamw_beta1(self.groups)  # a cycled 'momentum' is AdamW's beta1
        with deferred_sigint():
            t0_ns = time.monotonic_ns()
            adamw_step()
            if self.trace is not None:
                self.trace.complete("adamw step", t0_ns, time.monotonic_ns(),
                                    {"step": self.link.session.step})
            self.commit()
        self.after_commit()

    def commit(self):
        """step()'s commit, after AdamW's step (SIGINT deferred by the
        caller): from here the step is completed, never rolled back."""
        if self.link.session is not None:
            self.pending, self.pending_step = True, self.link.session.step
            self.plan_next_handoff()
            self.recovery.committed()

    def after_commit(self):
        """The rest of step(): its updates applied (overlap_forward: by the
        next forward)."""
        if self.link.session is not None and not self.overlap_forward:
            self.synchronize()

    # --------------------------------------------------------------- session
    def open(self, job_id, flags, resume):
        """Opens the session of the table and installs the hooks."""
        self.link.open(self.server, job_id, flags, self.table, resume=resume)
        self.hooks.install(self.table, self.module, self.ddp, self.pg, self.world,
                           self.overlap_forward)
        self.trace = _trace.from_env(self.rank, self.world)
        if self.trace is not None and self.module is not None:
            self.trace_hooks = _trace_hooks.TraceHooks(
                self.trace, self.module, [r.param for r in self.table.muon],
                lambda: self.link.session.step if self.link.session is not None else None)

    def load_momentum(self, state):
        """load_state_dict(): dmuond's momentum and step count replaced by
        `state` (StateView.check_loadable's, checked)."""
        if self.world > 1:
            # dmuond refuses SetState while a GetState of the job is
            # streaming: another rank may still be in the state_dict()
            # before this load (each rank sets the same whole state).
            _ddp.barrier(self.pg)
        self.link.session.set_state(state)
        self.trained = [bool(m.any()) for m in state["momentum"]]

    def grow(self, table):
        """Reopens the session with a grown table (add_param_group): the
        momentum of the entries it had carried over, the new ones' hooks
        installed."""
        old = self.link.session.get_state() if self.link.session is not None else None
        n_old = len(self.table.muon)
        if self.link.session is not None:
            self.link.release()
        self.table = table
        self.link.open(self.link.address if self.link.address is not None else self.server,
                       None, (), table)
        if old is not None:
            carried = dict(zip(old["names"], old["momentum"]))
            momentum = [carried.get(r.name, np.zeros(r.matrix, np.float32))
                        for r in table.muon]
            self.link.session.set_state({"completed_steps": int(old["completed_steps"]),
                                         "names": self.link.session.names,
                                         "momentum": momentum})
        self.trained += [False] * (len(table.muon) - n_old)
        self.hooks.extend(table, n_old, self.module, self.overlap_forward)
        self.reset_step()

    def close(self):
        self.hooks.remove()
        if self.trace_hooks is not None:
            self.trace_hooks.remove()
        self.link.close()
        if self.trace is not None:
            self.trace.flush()

"""DMuon after an interrupted step: a KeyboardInterrupt or an exception in
backward (any hook: a module's, a tensor's, DMuon's own), in step(), or in
a forward pre-hook that applies updates (overlap_forward) leaves DMuon
usable, and the next step() equals torch.optim.Muon + AdamW's.

The rule (client/python/README.md, "Interrupts and exceptions"):

- Before a step commits, it is rolled back. A step commits in step() once
  every Muon gradient is with dmuond and the local AdamW has stepped. A
  backward that handed gradients to dmuond and did not finish (its
  autograd graph task ended without running its completion callback), or a
  step() that raised before it committed (an error stored by a hook, a
  changed hyperparameter, a KeyboardInterrupt), voids dmuond's step: the
  step is completed and undone (Rewind: dmuond puts every matrix's momentum
  back to before it; one process on host buffers), or else the session is
  closed mid-step, which makes dmuond put the job's momentum back to its
  last completed step (CPU executors keep the pre-step copy), and the same
  job is reopened (a step dmuond had completed cannot be undone that way:
  that raises, naming it). Nothing was applied to a parameter, AdamW did not
  step, so the step is as if it had not begun; the next step() hands every
  gradient over from .grad, which is what torch's step() would read.
- After a step commits, it is completed: the updates not applied yet are
  applied by the next call that needs them (the next forward's pre-hooks,
  the next hand-off, step(), zero_grad(), synchronize(), state_dict()).
  Each parameter's update is applied atomically (computed aside, then
  copied in, re-done from the copy if interrupted), and AdamW's step runs
  with SIGINT deferred to its end (main thread, default handler only).

Every wait on dmuond is bounded by the optimizer's `timeout`. With
torch.distributed (several ranks) a rollback would need every rank at
once: it raises, naming what to do.

_RecoveryMixin is a part of DMuon (dmuon.optim); it uses DMuon's
attributes: _muon, _group_of, _session, _region, _daemon, _finalizer,
_handed, _pending, _world, _pg, _rank, _open_args, _opened, address,
job_id, _attach, _cuda_device, _reset_step.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import weakref

import torch

from . import _errors, _session

_engine = torch.autograd.Variable._execution_engine


class _Backward:
    """One backward (an autograd graph task) that handed gradients over:
    `done` once the graph task finished (its queued callback ran); a graph
    task that raised drops its callbacks unrun, so `alive()` turns False
    with `done` still False."""

    __slots__ = ("task", "done", "_ref")

    def __init__(self, task):
        self.task, self.done = task, False

        def finished(record=self):  # queued on the graph task; holds only this
            record.done = True

        _engine.queue_callback(finished)
        self._ref = weakref.ref(finished)

    def aborted(self):
        return not self.done and self._ref() is None


@contextlib.contextmanager
def deferred_sigint():
    """SIGINT (Ctrl-C) arriving inside is raised as KeyboardInterrupt at its
    end, so the code inside runs whole. Only in the main thread with Python's
    default handler installed; otherwise a no-op."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    got = []
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if got:
            raise KeyboardInterrupt


class _RecoveryMixin:
    """Roll back an uncommitted step, complete a committed one (see the
    module docstring)."""

    def _init_recovery(self):
        self._backwards = {}  # graph task id -> _Backward, this step's
        self._stepping = False  # step() between its first change and commit
        self._staged = None  # (Muon index, new value) of an apply in progress
        self._lost = None  # a rollback that could not reopen the session
        self._pending_step = None  # the session's step when it committed

    def _track_backward(self):
        """Called by each hand-off: remembers the backward it came from."""
        task = torch._C._current_graph_task_id()
        if task >= 0 and task not in self._backwards:
            self._backwards[task] = _Backward(task)

    def _interrupted(self, backward_only=False):
        """Why the step in progress must be rolled back, or None."""
        if self._stepping and not backward_only:
            return "step() was interrupted before it committed"
        if any(b.aborted() for b in self._backwards.values()):
            return "a backward that handed gradients to dmuond did not finish"
        return None

    def _recover(self, backward_only=False):
        """Rolls back an interrupted, uncommitted step (cheap when there is
        none). A committed step's remaining updates are synchronize()'s.
        backward_only: only a backward that died (a hand-off: step() may be
        the caller)."""
        if self._lost is not None:
            raise self._lost
        if self._pending:
            return
        why = self._interrupted(backward_only)
        if why is not None:
            self._void_step(why)

    def _void_step(self, why, cause=None):
        """Voids dmuond's step in progress (see the module docstring) and
        resets this step's bookkeeping. cause: the dmuon error that ended the
        step, if one did."""
        self._stepping = True  # until it is rolled back: the next call retries
        if self._session is None or not any(self._handed):
            self._backwards, self._stepping = {}, False
            self._reset_step()
            return
        if cause is not None:
            # A private dmuond that died took the momentum with it: nothing to
            # roll back or reopen (a reopen would wait out the whole timeout
            # for a daemon that is gone); say so now, and on every later call.
            err = _errors.explain(self._daemon, cause)
            if err is not cause:
                self._lost = err
                raise err from cause
        step = self._session.step
        if self._world > 1:
            raise RuntimeError(
                f"DMuon: step {step} was interrupted ({why}) after some gradients went "
                "to dmuond; with several ranks it cannot be rolled back by one rank: "
                "create a new DMuon on every rank and load_state_dict() the last "
                "checkpoint")
        if self._can_rewind() and all(self._handed):
            # Every gradient is with dmuond, which may have completed the step
            # already: it is finished here and undone (Rewind: momentum back
            # to before it). With some missing, dmuond cannot have completed
            # it, and closing the session mid-step rolls it back (below).
            self._backwards = {}
            self._rewind_step()
            self._stepping = False
            self.stats["voided_steps"] = self.stats.get("voided_steps", 0) + 1
            return
        timeout, transport = self._open_args
        self._finalizer.detach()
        old, self._session, self._grad, self._upd = self._session, None, None, None
        # Closing mid-step: dmuond rolls the job back to its last completed
        # step and keeps it for a reopen (docs/design.md, "State and snapshots").
        _session.release([old], self._region)
        del old
        try:
            with _errors.explained(self._daemon):
                (session, self._region, self._staging, _, self.address, _,
                 self.pool_owner) = _session.open_session(
                    self._pg, self._rank, self._world, self.address, self.job_id,
                    timeout, transport, (), list(self._table.table),
                    list(self._table.specs), self._cuda_device(transport),
                    # The job as rolled back (step - 1 completed): anything
                    # else (dropped meanwhile, replaced) is an error here,
                    # never a silent start from zero (resume="auto": as the
                    # DMuon was opened, for a dmuond older than 1.1).
                    resume=("auto" if getattr(self, "_resume", "auto") == "auto"
                            else "continue" if step > 1 else "fresh"))
        except Exception as e:
            self._lost = RuntimeError(
                f"DMuon: step {step} was interrupted ({why}); rolling it back closed "
                f"the dmuond session and reopening job '{self.job_id}' at "
                f"{self.address} failed: {e}. Create a new DMuon and load_state_dict() "
                "the last checkpoint")
            raise self._lost from e
        self._attach(session)
        self._momentum_cache = None
        self._backwards, self._stepping = {}, False
        self._reset_step()
        self.stats["voided_steps"] = self.stats.get("voided_steps", 0) + 1
        if session.step != step:
            raise RuntimeError(
                f"DMuon: step {step} was interrupted ({why}) and dmuond at {self.address} "
                f"could not roll it back (the job reopened at step {session.step}: its "
                "executors keep momentum in device memory, or the job was dropped); "
                "the Muon momentum is not what it was: load_state_dict() your last "
                "checkpoint")

    def _momentum_to_send(self, i):
        """This step's momentum (beta) for Muon matrix i, sent with its
        hand-off (GradientsReady.momentum, protocol minor 2), or None: its
        group's 'momentum' is the one the dmuond session was opened with and
        no scheduler cycles it. OneCycleLR/CyclicLR with cycle_momentum=True
        set each group's 'momentum' every step (and mark the groups with
        'base_momentum'/'max_momentum'), as torch.optim.Muon reads it."""
        g = self._table.group_of[i]
        group = self.param_groups[g]
        beta = float(group["momentum"])
        if not 0.0 <= beta < 1.0:  # NaN too
            raise ValueError(f"DMuon: param_groups[{g}]['momentum'] is "
                             f"{group['momentum']!r}; it must be in [0, 1)")
        if (beta == self._table.momentum.get(g) and "max_momentum" not in group
                and "base_momentum" not in group):
            return None
        return beta

    def _momentum_moved(self):
        """step(): the Muon indices handed off with another momentum than
        their group's now (a scheduler, or the user, changed it after the
        hand-off, during or after backward). With a rewind they are redone
        (exact); otherwise it raises naming the group."""
        moved = []
        for i, beta in enumerate(getattr(self, "_sent_beta", ())):
            if beta is None or not self._handed[i] or self._absent[i]:
                continue
            g = self._table.group_of[i]
            if float(self.param_groups[g]["momentum"]) != beta:
                moved.append(i)
        if moved and not self._can_rewind():
            g = self._table.group_of[moved[0]]
            raise RuntimeError(
                f"DMuon: param_groups[{g}]['momentum'] changed from "
                f"{self._sent_beta[moved[0]]!r} to "
                f"{self.param_groups[g]['momentum']!r} after the gradient of "
                f"{self._table.muon[moved[0]].name} was handed to dmuond for step "
                f"{self._session.step}; with "
                "GPU transports dmuond "
                "cannot redo a step: change the momentum (scheduler.step()) after "
                "optimizer.step() and before the next backward, or pass "
                "overlap=False so that gradients leave at step()")
        return moved

    def _adamw_beta1(self):
        """OneCycleLR/CyclicLR with cycle_momentum=True write 'momentum' into
        every group (DMuon's defaults have no 'betas') and mark it with
        'base_momentum'/'max_momentum': an AdamW group's is its beta1, as a
        torch.optim.AdamW's scheduler sets betas[0]. (An AdamW group added
        later gets the defaults' 'momentum' unmarked: not its beta1.)"""
        for group in self.param_groups:
            if (not group.get("use_muon", True) and "momentum" in group
                    and ("max_momentum" in group or "base_momentum" in group)):
                group["betas"] = (group["momentum"], *tuple(group["betas"])[1:])

    def _stage_apply(self, i, p, value):
        """Writes `value` into parameter p (Muon index i) so that an interrupt
        leaves it either untouched or done: a retry copies the same value."""
        self._staged = (i, value)
        p.copy_(value)
        self._applied[i] = True
        self._staged = None

    def _restage(self, i, p):
        """An apply of i interrupted after it was staged: done again from
        its value. True if there was one."""
        if self._staged is None or self._staged[0] != i:
            return False
        with torch.no_grad():
            self._stage_apply(i, p, self._staged[1])
        return True

    def _before_forward(self, *args):
        """Root module's forward pre-hook: a step interrupted before it
        committed is rolled back, one that committed is completed (its
        updates must be in before this forward uses the parameters)."""
        self._recover()
        if self._pending and not self._overlap_forward:
            self.synchronize()
        self._check_shapes()

    def _settle(self):
        """zero_grad(): rolls back an interrupted step that had not committed
        (it still reads .grad) and completes one that had."""
        self._recover()
        if self._pending and not self._overlap_forward:
            self.synchronize()

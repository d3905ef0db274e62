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
  Each parameter's update is written whole, in place (Handoff.write: one
  native call, or SIGINT deferred to its end), so it is never half done
  nor done twice, and AdamW's step runs with SIGINT deferred to its end
  (main thread, default handler only).

Every wait on dmuond is bounded by the optimizer's `timeout`. With
torch.distributed (several ranks) a rollback would need every rank at
once: it raises, naming what to do.

Recovery holds what a rollback needs (this step's backwards, whether
step() is between its first change and its commit, the error that made
the optimizer unusable) and does it on the hand-off it is given
(dmuon/_handoff.py), which owns it.
"""

from __future__ import annotations

import _signal
import threading
import weakref

import torch

from . import _errors

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


class _Deferred:
    """The SIGINT handler while deferred: remembers that one came."""

    __slots__ = ("got",)

    def __init__(self):
        self.got = False

    def __call__(self, signum, frame):
        self.got = True


class deferred_sigint:  # lower case: used as a function, `with deferred_sigint():`
    """SIGINT (Ctrl-C) arriving inside is raised as KeyboardInterrupt at its
    end, so the code inside runs whole. Only in the main thread with Python's
    default handler installed; otherwise a no-op.

    It runs around the hand-offs and the writes of updates that the native
    calls do not take (dmuon/_handoff.py), and around AdamW's step, so it
    is kept cheap (about 1 µs against 10 for a
    generator around signal.signal, whose enum conversions cost the most;
    2026-12-07, AMD EPYC VM): a plain class, and _signal's getsignal and
    signal, which are signal.py's without the enum wrapping (the handlers
    are the same objects)."""

    __slots__ = ("_deferred",)

    def __enter__(self):
        if (threading.current_thread() is not threading.main_thread()
                or _signal.getsignal(_signal.SIGINT) is not _signal.default_int_handler):
            self._deferred = None
            return
        self._deferred = _Deferred()
        _signal.signal(_signal.SIGINT, self._deferred)

    def __exit__(self, *exc):
        if self._deferred is None:
            return False
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
        if self._deferred.got:
            raise KeyboardInterrupt
        return False


class Recovery:
    """Rolls back an uncommitted step (see the module docstring). resume:
    the session's resume mode, for the reopen after a rollback."""

    def __init__(self, resume="auto"):
        self.resume = resume
        self.backwards = {}  # graph task id -> _Backward, this step's
        self.stepping = False  # step() between its first change and commit
        self.lost = None  # a rollback that could not reopen the session

    def tracked(self):
        """Whether the backward running now (autograd's current graph task)
        has handed a gradient off this step already: its first hand-off
        looked for a backward that died before it (recover) and tracked it,
        so its other hand-offs need not look again (a dozen µs each between
        backward's kernels). False outside backward. A backward on another
        thread that dies meanwhile is then found by step(), which looks
        again before its commit."""
        return self.lost is None and torch._C._current_graph_task_id() in self.backwards

    def track_backward(self):
        """Called by each backward's first hand-off: remembers the backward
        it came from."""
        task = torch._C._current_graph_task_id()
        if task >= 0 and task not in self.backwards:
            self.backwards[task] = _Backward(task)

    def committed(self):
        self.stepping, self.backwards = False, {}

    def interrupted(self, backward_only=False):
        """Why the step in progress must be rolled back, or None."""
        if self.stepping and not backward_only:
            return "step() was interrupted before it committed"
        if any(b.aborted() for b in self.backwards.values()):
            return "a backward that handed gradients to dmuond did not finish"
        return None

    def recover(self, h, backward_only=False):
        """Rolls back hand-off h's interrupted, uncommitted step (cheap when
        there is none). A committed step's remaining updates are
        h.synchronize()'s. backward_only: only a backward that died (a
        hand-off: step() may be the caller)."""
        if self.lost is not None:
            raise self.lost
        if h.pending:
            return
        why = self.interrupted(backward_only)
        if why is not None:
            self.void_step(h, why)

    def void_step(self, h, why, cause=None):
        """Voids dmuond's step in progress (see the module docstring) and
        resets hand-off h's step. cause: the dmuon error that ended the
        step, if one did."""
        self.stepping = True  # until it is rolled back: the next call retries
        link = h.link
        if link.session is None or not any(h.handed):
            self.backwards, self.stepping = {}, False
            h.reset_step()
            return
        if cause is not None:
            # A private dmuond that died took the momentum with it: nothing to
            # roll back or reopen (a reopen would wait out the whole timeout
            # for a daemon that is gone); say so now, and on every later call.
            err = _errors.explain(link, cause) if link.daemon is not None else cause
            if err is not cause:
                self.lost = err
                raise err from cause
        step = link.session.step
        if h.world > 1:
            raise RuntimeError(
                f"DMuon: step {step} was interrupted ({why}) after some gradients went "
                "to dmuond; with several ranks it cannot be rolled back by one rank: "
                "create a new DMuon on every rank and load_state_dict() the last "
                "checkpoint")
        if h.can_rewind() and all(h.handed):
            # Every gradient is with dmuond, which may have completed the step
            # already: it is finished here and undone (Rewind: momentum back
            # to before it). With some missing, dmuond cannot have completed
            # it, and closing the session mid-step rolls it back (below).
            self.backwards = {}
            h.rewind()
            self.stepping = False
            h.stats["voided_steps"] = h.stats.get("voided_steps", 0) + 1
            return
        # Closing mid-step: dmuond rolls the job back to its last completed
        # step and keeps it for a reopen (docs/design.md, "State and snapshots").
        link.release()
        try:
            with _errors.explained(link):
                # The job as rolled back (step - 1 completed): anything else
                # (dropped meanwhile, replaced) is an error here, never a
                # silent start from zero (resume="auto": as the DMuon was
                # opened, for a dmuond older than 1.1).
                link.open(link.address, link.job_id, (), h.table,
                          resume=("auto" if self.resume == "auto"
                                  else "continue" if step > 1 else "fresh"))
        except Exception as e:
            self.lost = RuntimeError(
                f"DMuon: step {step} was interrupted ({why}); rolling it back closed "
                f"the dmuond session and reopening job '{link.job_id}' at "
                f"{link.address} failed: {e}. Create a new DMuon and load_state_dict() "
                "the last checkpoint")
            raise self.lost from e
        self.backwards, self.stepping = {}, False
        h.reset_step()
        h.stats["voided_steps"] = h.stats.get("voided_steps", 0) + 1
        if link.session.step != step:
            raise RuntimeError(
                f"DMuon: step {step} was interrupted ({why}) and dmuond at {link.address} "
                f"could not roll it back (the job reopened at step {link.session.step}: "
                "its executors keep momentum in device memory, or the job was dropped); "
                "the Muon momentum is not what it was: load_state_dict() your last "
                "checkpoint")

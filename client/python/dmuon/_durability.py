"""Whether dmuond kept its promise that an acknowledged step is durable.

A step that dmuond's ``--snapshot-every`` snapshots is acknowledged only
once its snapshot is written; when the write fails (a full or unwritable
``--state-dir``) the step still completes, with the reason in
``StepComplete.not_durable`` (``Session.not_durable``). The trainer's
numbers are right, but a restarted dmuond would resume the job from an older
step, so the user is told: one ``RuntimeWarning`` per distinct reason, and
``DMuon.stats["not_durable_steps"]`` counts them all.
"""

from __future__ import annotations

import re
import warnings


class Durability:
    """Watches each completed step's ``not_durable`` for one DMuon."""

    def __init__(self, stats: dict) -> None:
        self.stats = stats
        self.stats.setdefault("not_durable_steps", 0)
        self.warned: set[str] = set()

    def completed(self, session) -> None:
        """After ``session.finish_step()``: warns if that step is not durable."""
        why = session.not_durable
        if not why:
            return
        self.stats["not_durable_steps"] += 1
        # One warning per kind of reason: a reason naming its step (a stale
        # state refused "at step N") is the same reason at every step.
        self._warn_once(
            re.sub(r"\d+", "N", why),
            f"dmuond could not save step {session.step - 1} of this job to its "
            f"--state-dir ({why}): the step is applied and its updates are right, "
            "but a restarted dmuond would resume this job from an older step. Free "
            "or fix the state directory (`dmuonctl status` lists the snapshot "
            "errors); DMuon.stats['not_durable_steps'] counts such steps.")

    def not_durable_mark(self, step: int, why: str) -> None:
        """A mark (DMuon.mark(), state_dict()) dmuond holds in memory only."""
        self.stats["not_durable_marks"] = self.stats.get("not_durable_marks", 0) + 1
        self._warn_once(
            "mark " + re.sub(r"\d+", "N", why),
            f"dmuond could not write its mark of step {step} of this job to its "
            f"--state-dir ({why}): the mark is held in memory, but a restarted dmuond "
            "would not have it, and a trainer restarted from this step's checkpoint "
            "could not resume. Free or fix the state directory; DMuon.stats"
            "['not_durable_marks'] counts such marks.")

    def _warn_once(self, kind: str, message: str) -> None:
        """One RuntimeWarning per kind of reason (a reason naming its step is
        the same reason at every step), from the DMuon call's caller."""
        if kind in self.warned:
            return
        self.warned.add(kind)
        warnings.warn(message, RuntimeWarning, stacklevel=5)

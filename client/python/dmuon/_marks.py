"""DMuon's marks: dmuond keeps the momentum of the steps a trainer
checkpointed, so that a restarted trainer (any world size) that loads the
checkpoint of step N and opens the job with ``resume=N`` continues exactly
(docs/protocol.md "Marks"; client/python/README.md "Resuming on a
restarted shared daemon").

- ``DMuon.mark()`` marks the step the job is at: rank 0 asks dmuond
  (``Session.mark``), every rank gets its answer (one broadcast).
- ``DMuon.state_dict()`` marks the step automatically, once per step, from
  rank 0 alone (no collective: ``torch.save(opt.state_dict())`` on rank 0
  only must not hang). A daemon older than protocol 1.5 cannot mark, and
  one may refuse a mark (``--mark-bytes``): in "full" mode the checkpoint
  (which carries the momentum) is still taken, and the fallback
  ``unmarked`` is counted and warned once (``DMuon(strict=True)`` raises
  instead); in "reference" mode a refused mark raises on rank 0, as the
  checkpoint would be useless without it.
- ``DaemonOptions(checkpoint_momentum="reference")``: state_dict() carries
  each Muon parameter's "step" but no "momentum_buffer" (the momentum stays
  on dmuond, as the mark of that step), and the "dmuon" entry gains
  ``"momentum_ref": {"job_id", "step"}``. load_state_dict() of such a
  checkpoint (DCP drops the "dmuon" entry: the per-parameter "step" says
  which step) loads no momentum and requires the job to be at that step
  (the trainer opened it with ``resume=N``); else it raises naming the job,
  both steps and the fix. On a daemon that cannot mark, reference mode
  saves the momentum in full (the same ``unmarked`` fallback), as every
  rank sees the same daemon version.
"""

from __future__ import annotations

from collections.abc import Mapping

from . import _ddp, _native

MARK_MINOR = 5  # the protocol minor Session.mark needs (client/wire.h kMarkMinor)
CHECKPOINT_MOMENTUM = ("full", "reference")


def checkpoint_mode(value):
    """DaemonOptions.checkpoint_momentum, checked."""
    if value not in CHECKPOINT_MOMENTUM:
        raise ValueError(
            f"DMuon: DaemonOptions(checkpoint_momentum={value!r}) is not \"full\" (the "
            "default: state_dict() carries dmuond's momentum) or \"reference\" (it "
            "carries a reference to dmuond's mark of the step instead)")
    return value


class Marks:
    """One DMuon's marks: mark(), state_dict()'s automatic mark and the
    reference mode's checks (see the module docstring)."""

    def __init__(self, handoff, mode="full"):
        self._handoff = handoff
        self.mode = checkpoint_mode(mode)
        self.marked = None  # (session, step) rank 0 last marked
        handoff.stats.setdefault("marks", [])  # the job's marks, as dmuond answered

    @property
    def session(self):
        return self._handoff.link.session

    def can_mark(self):
        """Whether the daemon (every one of a pool) speaks protocol 1.5."""
        return self.session is not None and self.session.protocol_minor >= MARK_MINOR

    def reference(self):
        """Whether state_dict() carries a reference instead of the momentum:
        reference mode on a daemon that can mark (the same on every rank)."""
        return self.mode == "reference" and self.can_mark()

    def _ask(self):
        """Rank 0's Mark of the step the job is at; its answer, kept."""
        session = self.session
        answer = session.mark(0)
        self.marked = (session, int(answer["step"]))
        self._handoff.stats["marks"] = list(answer["marks"])
        if answer["not_durable"]:
            self._handoff.durability.not_durable_mark(answer["step"],
                                                      answer["not_durable"])
        return int(answer["step"])

    def mark(self):
        """DMuon.mark(): every rank, between steps; the step marked."""
        h = self._handoff
        h.at_boundary("mark")
        if self.session is None:
            raise RuntimeError("DMuon.mark(): this optimizer has no Muon parameters, "
                               "so dmuond holds nothing of it to mark")
        step, err = None, None
        if h.rank == 0:
            try:
                step = self._ask()
            except _native.load().Error as e:
                err = e
        if h.world > 1:
            step, why = _ddp.broadcast(
                (step, None if err is None else f"{type(err).__name__}: {err}"), h.pg)
            if why is not None and err is None:
                raise RuntimeError(f"DMuon.mark(): rank 0's mark of job "
                                   f"'{h.link.job_id}' failed: {why}")
        if err is not None:
            raise err
        return step

    def auto_mark(self):
        """state_dict(): rank 0 marks the step the job is at, once per step
        (nothing before the first step); a daemon that cannot mark is the
        fallback 'unmarked'."""
        h, session = self._handoff, self.session
        done = session.step - 1 if session is not None else 0
        if done == 0 or self.marked == (session, done):
            return
        if not self.can_mark():
            self.marked = (session, done)  # once per step
            full = " (its momentum in full, not by reference)" if self.mode == "reference" else ""
            h.fallbacks.take(
                "unmarked",
                f"dmuond at {h.link.address} speaks protocol 1.{session.protocol_minor}, "
                f"older than 1.{MARK_MINOR}: state_dict() takes the checkpoint of step "
                f"{done}{full} without marking it, so a restarted trainer can resume "
                f"job '{h.link.job_id}' at step {done} only while dmuond's job is at it")
            return
        if h.rank != 0:
            self.marked = (session, done)
            return
        if self.mode == "reference":
            try:
                self._ask()
            except _native.load().Error as e:
                # The checkpoint is only good with its mark: raised, as its
                # type (and gRPC code), saying what to change.
                e.args = (f"DMuon.state_dict(): dmuond at {h.link.address} did not "
                          f"mark step {done} of job '{h.link.job_id}', and a "
                          "checkpoint_momentum='reference' checkpoint is only good "
                          f"with its mark: {e}. Give dmuond room for marks "
                          "(--mark-bytes), or use checkpoint_momentum='full'",)
                raise
            return
        try:
            self._ask()
        except _native.load().Error as e:
            if getattr(e, "code", "") != "RESOURCE_EXHAUSTED":
                raise
            # Refused for room (dmuond --mark-bytes=0, or a job larger than
            # the budget): a full checkpoint carries the momentum itself and
            # stays good without the mark, so it is taken, the fallback
            # counted and warned once. (Other errors, a lost daemon, raise:
            # the momentum could not be fetched either.)
            self.marked = (session, done)
            h.fallbacks.take(
                "unmarked",
                f"dmuond at {h.link.address} did not mark step {done} of job "
                f"'{h.link.job_id}' ({e.code}: {e}); the checkpoint carries the "
                "momentum in full, so it is taken, but a restarted trainer cannot "
                f"resume the job at step {done} by resume={done} alone")

    def check_reference_load(self, state_dict, steps):
        """load_state_dict() of a checkpoint whose Muon momentum is a
        reference (momentum_ref, or reference mode and Muon "step"s without
        momentum): the job must be at its step. `steps`: the Muon
        parameters' "step" values. Raises ValueError naming the job, both
        steps and the fix; returns the checkpoint's step."""
        h = self._handoff
        dm = state_dict.get("dmuon")
        ref = dm.get("momentum_ref") if isinstance(dm, Mapping) else None
        if isinstance(ref, Mapping):
            want, job = int(ref.get("step", -1)), ref.get("job_id")
        else:
            want, job = int(max(float(s) for s in steps)), None
        have = self.session.step - 1
        if job is not None and job != h.link.job_id:
            raise ValueError(
                f"DMuon.load_state_dict: the checkpoint's Muon momentum is dmuond's mark "
                f"of step {want} of job '{job}', but this optimizer opened job "
                f"'{h.link.job_id}': create it with DaemonOptions(job_id='{job}', "
                f"resume={want})")
        if have != want:
            raise ValueError(
                f"DMuon.load_state_dict: the checkpoint holds a reference to dmuond's "
                f"momentum of step {want} (checkpoint_momentum='reference'), but job "
                f"'{h.link.job_id}' on dmuond is at step {have}: create the optimizer "
                f"with DaemonOptions(job_id='{h.link.job_id}', resume={want}) so that "
                f"dmuond resumes the job at the step's mark, then load the checkpoint")
        return want

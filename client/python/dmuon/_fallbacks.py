"""DMuon's fallbacks: every place where the trainer's side takes a slower or
different path than the one asked for, counted by kind in
``DMuon.stats["fallbacks"]`` so that none is silent (docs/design.md,
"Fallbacks"). Each kind is warned once per optimizer, at its first
occurrence, with its reason; ``DMuon(..., strict=True)`` raises instead of
taking it.

The kinds (a fixed set; every one is in the dict from the start, at 0):

- ``host_staging``: CUDA parameters whose gradients and updates go through
  host memory (transport="auto" and dmuond offers no GPU transport, or a
  pool of daemons), and Newton-Schulz runs wherever that dmuond computes.
  Strict: raised before the host session opens.
- ``private_daemon``: DaemonOptions(server="auto") without ``$DMUON_SERVER``
  starts a private dmuond on this host. Strict: raised before it starts.
- ``redo``: at ``step()``, gradients edited after their overlapped hand-off
  (clipping, unscaling, masking) or a momentum changed since: dmuond's step
  is rewound and computed again. Strict: raised before the rewind (the step
  is voided, as on any error before the commit).
- ``rewind``: a second backward before ``step()`` (accumulation without
  ``no_sync()``, a skipped step): dmuond's step of the first is rewound.
  Strict: raised from the backward hook before the rewind.
- ``unmarked``: ``state_dict()`` on a dmuond older than protocol 1.5, which
  cannot mark the step (dmuon/_marks.py): the checkpoint is taken unmarked
  (``checkpoint_momentum="reference"``: with the momentum in full). Strict:
  raised before the checkpoint is taken.

dmuond counts its own kinds (graph_eager, unhealthy_executor, and every
rewind it performs) in its Status and /metrics; these stay on this side:
only this process knows what it asked for, and reporting them would need a
protocol change for numbers the trainer already has.
"""

from __future__ import annotations

import warnings

KINDS = ("host_staging", "private_daemon", "redo", "rewind", "unmarked")

# What to change so that each kind is not taken (strict mode's message).
REMEDIES = {
    "host_staging": "run a GPU dmuond (dmuond_cuda) reachable from this host and "
                    "set $DMUON_SERVER to it, or pass DaemonOptions(transport="
                    "'cuda_ipc') or 'nccl' to require a GPU transport",
    "private_daemon": "start dmuond (dmuond --listen=HOST:PORT) and set "
                      "$DMUON_SERVER=HOST:PORT, or pass DaemonOptions(server="
                      "'HOST:PORT')",
    "redo": "edit gradients before backward() returns, or pass overlap_options="
            "OverlapOptions(backward=False) so that gradients leave at step(), "
            "after your edits",
    "rewind": "run every backward but the last of a step inside `with "
              "optimizer.no_sync():`, or pass overlap_options=OverlapOptions("
              "backward=False)",
    "unmarked": "upgrade dmuond to protocol 1.5 or newer (`dmuonctl status` "
                "shows its version), or give it room for marks (--mark-bytes)",
}


class Fallbacks:
    """One DMuon's fallback counts (in ``stats["fallbacks"]``), warnings and
    strict mode."""

    def __init__(self, stats: dict, strict: bool = False) -> None:
        self.strict = strict
        self.counts = stats.setdefault("fallbacks", {})
        for kind in KINDS:
            self.counts.setdefault(kind, 0)
        self.warned: set[str] = set()

    def take(self, kind: str, reason: str, warn: bool = True) -> None:
        """A fallback of `kind` about to be taken for `reason`: counted and,
        the first time, warned (`warn` False: the caller warns itself). In
        strict mode a RuntimeError naming the kind, the reason and what to
        change is raised instead, and nothing is counted."""
        if kind not in REMEDIES:
            raise ValueError(f"DMuon: unknown fallback kind {kind!r}; one of {KINDS}")
        if self.strict:
            raise RuntimeError(
                f"DMuon(strict=True) refuses the fallback '{kind}': {reason}. "
                f"To avoid it: {REMEDIES[kind]}; or pass strict=False to take it "
                "(counted in optimizer.stats['fallbacks'])")
        self.counts[kind] += 1
        if kind in self.warned:
            return
        self.warned.add(kind)
        if warn:
            warnings.warn(
                f"DMuon: fallback '{kind}': {reason} (warned once; "
                "optimizer.stats['fallbacks'] counts them; strict=True raises "
                "instead)", RuntimeWarning, stacklevel=4)

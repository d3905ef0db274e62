"""The trainer's step timeline: DMUON_TRACE=FILE makes DMuon record, in
Chrome's trace-event JSON (Perfetto, chrome://tracing), what dmuond's
--trace-file records on its side (docs/design.md, "Tracing"):

    per Muon matrix, each step   ready (its gradient accumulated: the backward
                                 hook), handoff (copied out), declare
                                 (GradientsReady written to dmuond's
                                 stream, or its doorbell word), update_received
                                 (the client saw dmuond's UpdatesReady: read
                                 off the stream by its reader thread, or with
                                 the doorbell taken from it by the wait or
                                 the poll that first looked after it landed;
                                 dmuond's `return` ends when it landed), wait
                                 (blocked on it) and apply (W <- W (1 - lr
                                 wd) - lr U)
    per step                     forward, backward, step() and AdamW's step
    per module (tracing only)    the forward of each module that owns a Muon
                                 matrix

Matrix events are named "<stage> <parameter name>" and carry the args
`stage`, `job`, `step`, `param` (the dmuond table index), `name` and `shape`,
as the daemon's do: `python -m dmuon.trace merge OUT IN...` (dmuon/trace.py)
links a matrix's events across the files by (job, step, name).

Clock: time.monotonic_ns (CLOCK_MONOTONIC on Linux), the daemon's, so the
files of one host line up; "otherData" records the wall-clock minus
monotonic offset for files of several hosts.

Cost: one tuple appended to a list per event (the GIL orders them);
nothing is formatted until a flush. Every FLUSH_EVERY events, at DMuon's
close() and at exit, the pending events are written: the file is rewritten
from where its footer began, so it is a whole JSON document after every
flush. At most MAX_PENDING events wait between flushes; past it an event
is dropped and counted ("dropped_events").

With several ranks each writes FILE with ".rank<r>" before its suffix.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import sys
import threading
import time
from typing import Any

FLUSH_EVERY = 4096
MAX_PENDING = 1 << 18

_HEAD = '{"traceEvents":[\n'


class Tracer:
    """One process's step timeline, written to `path` (see the module
    docstring). Thread-safe for recording."""

    def __init__(self, path: str, process_name: str) -> None:
        self.path, self.process_name = path, process_name
        self.pid = os.getpid()
        self.dropped = 0
        # Appended by any thread, taken from the left by flush() (deque ends
        # are thread-safe: an event recorded during a flush is never lost).
        self._pending: collections.deque[tuple] = collections.deque()
        # This thread's tid (per thread object: an ident is reused once its
        # thread ended, a threading.local is not).
        self._local = threading.local()
        self._names: dict[int, str] = {}  # tid -> name
        self._lock = threading.Lock()  # flushes
        self._footer_at = None  # the file offset where the footer begins
        self._wrote_event = False
        self._written = None  # (thread names, dropped) the file's footer has

    # ------------------------------------------------------------ recording
    def _tid(self) -> int:
        tid = getattr(self._local, "tid", None)
        if tid is None:
            with self._lock:
                tid = self._local.tid = len(self._names) + 1
                t = threading.current_thread()
                main = t is threading.main_thread()
                self._names[tid] = "trainer (main thread)" if main else t.name
        return tid

    def _add(self, event: tuple) -> None:
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1
            return
        self._pending.append(event)
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def complete(self, name: str, start_ns: int, end_ns: int,
                 args: dict[str, Any] | None = None) -> None:
        """A span [start_ns, end_ns] (time.monotonic_ns) of this thread."""
        self._add(("X", name, start_ns, max(0, end_ns - start_ns), self._tid(), args))

    def instant(self, name: str, ts_ns: int, args: dict[str, Any] | None = None) -> None:
        """A moment of this thread."""
        self._add(("i", name, ts_ns, 0, self._tid(), args))

    # -------------------------------------------------------------- writing
    def _event_json(self, e: tuple) -> str:
        ph, name, ts, dur, tid, args = e
        d: dict[str, Any] = {"ph": ph, "name": name, "cat": "trainer", "pid": self.pid,
                             "tid": tid, "ts": ts / 1000.0}
        if ph == "X":
            d["dur"] = dur / 1000.0
        else:
            d["s"] = "t"
        if args:
            d["args"] = args
        return json.dumps(d)

    def _metadata(self) -> list[str]:
        out = [json.dumps({"ph": "M", "name": "process_name", "pid": self.pid, "tid": 0,
                           "args": {"name": self.process_name}})]
        for tid, name in sorted(self._names.items()):
            out.append(json.dumps({"ph": "M", "name": "thread_name", "pid": self.pid,
                                   "tid": tid, "args": {"name": name}}))
        return out

    def _footer(self) -> str:
        mono, wall = time.monotonic_ns(), time.time_ns()
        other = {"clock": "CLOCK_MONOTONIC",
                 "wall_minus_monotonic_us": (wall - mono) // 1000,
                 "process": self.process_name, "dropped_events": self.dropped}
        return "\n],\n\"otherData\":" + json.dumps(other) + "}\n"

    def flush(self) -> None:
        """Writes the pending events; the file is whole JSON afterwards."""
        with self._lock:
            if not self._pending and self._written == (len(self._names), self.dropped):
                return  # the file has it all
            events = [self._pending.popleft() for _ in range(len(self._pending))]
            self._written = (len(self._names), self.dropped)
            lines = [self._event_json(e) for e in events]
            if self._footer_at is None:
                with open(self.path, "w") as f:
                    f.write(_HEAD)
                    self._footer_at = f.tell()
            # The thread names (metadata events may be anywhere) go before
            # the footer each time, replaced by the next flush's.
            meta = self._metadata()
            with open(self.path, "r+") as f:
                f.seek(self._footer_at)
                body = ",\n".join(lines)
                if body:
                    f.write((",\n" if self._wrote_event else "") + body)
                    self._wrote_event = True
                self._footer_at = f.tell()
                f.write((",\n" if self._wrote_event else "") + ",\n".join(meta))
                f.write(self._footer())
                f.truncate()


_tracers: dict[str, Tracer] = {}


def path_for(path: str, rank: int, world: int) -> str:
    """FILE, or FILE with ".rank<r>" before its suffix when world > 1."""
    if world <= 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def from_env(rank: int = 0, world: int = 1) -> Tracer | None:
    """The process's Tracer when DMUON_TRACE names a file, else None. One
    per file in a process (several DMuon share it), flushed at exit."""
    path = os.environ.get("DMUON_TRACE")
    if not path:
        return None
    path = path_for(path, rank, world)
    t = _tracers.get(path)
    if t is None:
        name = "trainer" if world <= 1 else f"trainer (rank {rank})"
        t = _tracers[path] = Tracer(path, f"{name} pid {os.getpid()}")
        atexit.register(_flush_at_exit, t)
    return t


def _flush_at_exit(t: Tracer) -> None:
    try:
        t.flush()
    except OSError as e:  # its directory went away: not the exit's error
        print(f"dmuon: DMUON_TRACE={t.path} could not be written at exit: {e}",
              file=sys.stderr)


def daemon_trace_path(path: str) -> str:
    """Where a private dmuond (server="auto") writes its side of FILE's
    timeline: FILE's name with ".dmuond" before its suffix."""
    root, ext = os.path.splitext(path)
    return f"{root}.dmuond{ext or '.json'}"

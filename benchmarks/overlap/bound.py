"""The critical-path bound of `./dmuon bench overlap`: the shortest step an
ideal pipeline could make of the measured work, by event simulation.

A trainer's step starts with backward (segments S-1 .. 0; segment k's
matrices' gradients are ready when its backward ends), then the work after
backward (AdamW on the rest, the loop), then forward (segments 0 .. S-1);
forward segment k cannot start before every update of segment k is done. The
daemon's devices run one matrix at a time (its measured Newton-Schulz time),
and a free device always takes the ready matrix the next forward needs first
(lowest segment, then the earliest ready, then the lowest trainer), as
dmuond's scheduler orders work and as the scaling simulator's kDedicated
placement does (benchmarks/scaling/simulator.h). Hand-offs cost nothing.
The step ends when the forward's last segment (the loss) does; since every
update of the step is then done, the next step starts from the same state,
and that end is the iteration's bound.

Several trainers (each measured alone on the trainer cores, with all of
them) share those cores fairly: while n of them have work they can do, each
runs at 1/n of its speed (processor sharing); one waiting for an update
leaves its share to the others. All start in phase. One trainer is the
plain pipeline.
"""

from __future__ import annotations

import dataclasses
import heapq


@dataclasses.dataclass
class Trainer:
    """One trainer's measured step (seconds), segments in forward order."""

    forward_s: list[float]
    backward_s: list[float]
    after_backward_s: float = 0.0
    # (segment, device seconds) of each Muon matrix.
    tasks: list[tuple[int, float]] = dataclasses.field(default_factory=list)

    def work(self) -> float:
        """Its compute alone, with no wait: the step with free updates."""
        return sum(self.forward_s) + sum(self.backward_s) + self.after_backward_s


@dataclasses.dataclass
class Result:
    iteration_s: list[float]  # per trainer: the bound
    backward_end_s: list[float]
    device_busy_s: list[float]


def _check(trainers: list[Trainer], devices: int) -> None:
    if not trainers or devices < 1:
        raise ValueError("bound: needs at least one trainer and one device")
    for n, t in enumerate(trainers):
        segs = len(t.forward_s)
        if segs == 0 or len(t.backward_s) != segs:
            raise ValueError(f"bound: trainer {n}: forward_s and backward_s need one "
                             "entry per segment")
        times = list(t.forward_s) + list(t.backward_s) + [t.after_backward_s]
        times += [s for _, s in t.tasks]
        if any(not x >= 0 for x in times):
            raise ValueError(f"bound: trainer {n}: a negative or NaN time")
        if any(not 0 <= seg < segs for seg, _ in t.tasks):
            raise ValueError(f"bound: trainer {n}: a task's segment is out of range")


class _Sim:
    def __init__(self, trainers: list[Trainer], devices: int) -> None:
        self.tr = trainers
        # Each trainer's work items in order: ("b", seg), ("a", 0), ("f", seg).
        self.items = [[("b", s) for s in reversed(range(len(t.forward_s)))] + [("a", 0)]
                      + [("f", s) for s in range(len(t.forward_s))] for t in trainers]
        self.pos = [0] * len(trainers)
        self.left = [self._length(n) for n in range(len(trainers))]
        self.missing = [[0] * len(t.forward_s) for t in trainers]
        for n, t in enumerate(trainers):
            for seg, _ in t.tasks:
                self.missing[n][seg] += 1
        self.ready: list[tuple[int, float, int, int]] = []  # heap
        self.free_at = [0.0] * devices  # when each device is free
        self.running: list[tuple[float, int, int]] = []  # heap (end, trainer, segment)
        self.busy = [0.0] * devices
        self.end = [0.0] * len(trainers)
        self.backward_end = [0.0] * len(trainers)

    def _length(self, n: int) -> float:
        """Seconds (alone on the cores) of trainer n's current work item."""
        kind, s = self.items[n][self.pos[n]]
        t = self.tr[n]
        if kind == "a":
            return t.after_backward_s
        return (t.backward_s if kind == "b" else t.forward_s)[s]

    def _runnable(self, n: int) -> bool:
        if self.pos[n] >= len(self.items[n]):
            return False
        kind, s = self.items[n][self.pos[n]]
        return kind != "f" or self.missing[n][s] == 0

    def _finish_item(self, n: int, now: float) -> None:
        kind, s = self.items[n][self.pos[n]]
        if kind == "b":
            for i, (seg, _) in enumerate(self.tr[n].tasks):
                if seg == s:
                    heapq.heappush(self.ready, (seg, now, n, i))
            if s == 0:
                self.backward_end[n] = now
        self.pos[n] += 1
        if self.pos[n] == len(self.items[n]):
            self.end[n] = now
        else:
            self.left[n] = self._length(n)

    def _dispatch(self, now: float) -> None:
        for d in range(len(self.free_at)):
            if self.free_at[d] <= now and self.ready:
                seg, _, n, i = heapq.heappop(self.ready)
                secs = self.tr[n].tasks[i][1]
                self.free_at[d] = now + secs
                self.busy[d] += secs
                heapq.heappush(self.running, (now + secs, n, seg))

    def run(self) -> Result:
        now = 0.0
        while True:
            # Zero-length items finish at once; then the devices take work.
            for n in range(len(self.tr)):
                while self._runnable(n) and self.left[n] <= 0:
                    self._finish_item(n, now)
            self._dispatch(now)
            active = [n for n in range(len(self.tr)) if self._runnable(n)]
            if not active and not self.running:
                break
            share = len(active)
            ends = [now + self.left[n] * share for n in active]
            if self.running:
                ends.append(self.running[0][0])
            t_next = min(ends)
            for n in active:
                self.left[n] -= (t_next - now) / share
                if self.left[n] <= 1e-12 * max(1.0, t_next):
                    self.left[n] = 0.0
            now = t_next
            while self.running and self.running[0][0] <= now:
                _, n, seg = heapq.heappop(self.running)
                self.missing[n][seg] -= 1
        if any(p != len(i) for p, i in zip(self.pos, self.items)):
            raise RuntimeError("bound: the simulated step did not finish")
        return Result(self.end, self.backward_end, self.busy)


def simulate(trainers: list[Trainer], devices: int = 1) -> Result:
    """The bound (module docstring) of `trainers` sharing the trainer cores
    and `devices` daemon devices."""
    _check(trainers, devices)
    return _Sim(trainers, devices).run()

"""The bound's simulation (bound.py) against schedules worked out by hand,
and its invariants on fresh random steps; layer_times' segment arithmetic
against hand-made hook times."""

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bound import Trainer, simulate  # noqa: E402
from layer_times import _segments  # noqa: E402


def test_one_trainer_by_hand():
    # Backward: segment 2 ends at 3 (its matrix ready), 1 at 6, 0 at 7; the
    # rest until 7.5. Device: matrix of 2 from 3 to 4, of 1 from 6 to 10.
    # Forward: segment 0 7.5-8.5, 1 waits until 10 (10-12), 2 12-14.
    t = Trainer([1, 2, 2], [1, 3, 3], 0.5, [(1, 4.0), (2, 1.0)])
    r = simulate([t])
    assert r.iteration_s == [pytest.approx(14.0)]
    assert r.backward_end_s == [pytest.approx(7.0)]
    assert r.device_busy_s == [pytest.approx(5.0)]


def test_device_takes_what_forward_needs_first():
    # Segment 2's matrices a, b (3 s each) are ready at 1, segment 1's c (1 s)
    # at 2. a runs 1-4; then c (segment 1) before b: c 4-5, b 5-8. Forward:
    # 0 at 3-4, 1 at 5-6, 2 at 8-9. In arrival order (b before c) it would
    # end at 10.
    t = Trainer([1, 1, 1], [1, 1, 1], 0.0, [(2, 3.0), (2, 3.0), (1, 1.0)])
    assert simulate([t]).iteration_s == [pytest.approx(9.0)]
    # Two devices: a and b both 1-4, c 4-5; forward 0 3-4, 1 5-6, 2 6-7.
    assert simulate([t], devices=2).iteration_s == [pytest.approx(7.0)]


def test_two_trainers_share_the_cores():
    # No matrices: each trainer's 4 s of work at half speed.
    t = Trainer([1, 1], [0.5, 0.5], 1.0)
    assert simulate([t, t]).iteration_s == [pytest.approx(8.0)] * 2
    # Backward of segment 1 (1 s alone) ends at 2 for both; T0's matrix
    # (5 s, first at a tie) 2-7, T1's (0.5 s) 7-7.5. Backward 0 2-4, forward
    # 0 4-6 (both at half speed). T0's forward 1 starts at 7 alone (full
    # speed), T1 joins at 7.5: T0's last 0.5 s at half speed ends at 8.5,
    # T1's 1 s: 0.5 by 8.5, the rest alone by 9.
    t0 = Trainer([1, 1], [1, 1], 0.0, [(1, 5.0)])
    t1 = Trainer([1, 1], [1, 1], 0.0, [(1, 0.5)])
    r = simulate([t0, t1])
    assert r.iteration_s == [pytest.approx(8.5), pytest.approx(9.0)]


def random_trainer(rng, segs, tasks_per_seg):
    return Trainer([rng.uniform(0, 0.1) for _ in range(segs)],
                   [rng.uniform(0, 0.2) for _ in range(segs)], rng.uniform(0, 0.05),
                   [(s, rng.uniform(0, 0.08)) for s in range(1, segs)
                    for _ in range(tasks_per_seg)])


def test_invariants_on_random_steps():
    rng = random.Random()  # fresh inputs every run
    for _ in range(200):
        t = random_trainer(rng, rng.randint(1, 20), rng.randint(0, 4))
        ns = sum(s for _, s in t.tasks)
        r = simulate([t])
        it = r.iteration_s[0]
        # No faster than its own compute, nor than the daemon's work from the
        # first gradient on, nor than the last segment's backward, the
        # device's work and the segment's forward; never slower than running
        # everything one after the other.
        assert it >= t.work() - 1e-9
        if t.tasks:
            first = t.backward_s[-1] if any(s == len(t.forward_s) - 1 for s, _ in t.tasks) \
                else 0.0
            assert it >= first + ns - 1e-9
        assert it <= t.work() + ns + 1e-9
        assert r.device_busy_s[0] == pytest.approx(ns)
        # Free updates: exactly the compute; two identical trainers with
        # free updates: twice it each.
        free = Trainer(t.forward_s, t.backward_s, t.after_backward_s)
        assert simulate([free]).iteration_s[0] == pytest.approx(t.work())
        assert simulate([free, free]).iteration_s == [pytest.approx(2 * t.work())] * 2
        # A pair never beats one trainer alone, nor two daemons' worth of work.
        pair = simulate([t, t])
        assert min(pair.iteration_s) >= it - 1e-9
        assert max(pair.iteration_s) >= 2 * ns - 1e-9


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="one entry per segment"):
        simulate([Trainer([1, 1], [1])])
    with pytest.raises(ValueError, match="segment is out of range"):
        simulate([Trainer([1], [1], 0, [(1, 1.0)])])
    with pytest.raises(ValueError, match="negative"):
        simulate([Trainer([1], [-1])])
    with pytest.raises(ValueError, match="one device"):
        simulate([Trainer([1], [1])], devices=0)


def test_segments_from_hook_times():
    # Matrices 1..3 (forward order): pre-hooks at 2, 3, 5; backward from 7,
    # gradients of 3, 2, 1 at 8, 10, 11, backward returns at 12.
    fwd, bwd = _segments([2, 3, 5], [11, 10, 8], 0.5, 7, 12)
    assert fwd == [1.5, 1, 2, 2]
    assert bwd == [1, 1, 2, 1]
    with pytest.raises(RuntimeError, match="reverse"):
        _segments([2, 3, 5], [8, 10, 11], 0.5, 7, 12)

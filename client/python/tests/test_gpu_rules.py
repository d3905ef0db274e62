"""The GPU transports' rules as Python trainers get them: _dmuon.ReleaseGate
and _dmuon.NcclOrder are the C++ client's own (client/cuda/release_gate.h,
nccl_order.h, tested there), bound so that _gpu.py keeps no copy. These
tests check the binding: status names reach the gate's rule, the order calls
back with the right transfers, and errors cross the boundary intact."""

import random

import pytest

from dmuon import _native

_ext = _native.load()


def test_release_gate_holds_memory_after_an_unanswered_open():
    for code in ("DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN"):
        g = _ext.ReleaseGate()
        g.exported()
        assert not g.may_free
        g.open_failed(code)
        assert not g.may_free, code
        assert "without the daemon's answer" in g.why_not


def test_release_gate_frees_after_an_answered_open_or_a_local_failure():
    for code in ("NOT_FOUND", "INVALID_ARGUMENT", "UNIMPLEMENTED", None):
        g = _ext.ReleaseGate()
        g.exported()
        g.open_failed(code)
        assert g.may_free and g.why_not == "", code


def test_release_gate_follows_the_close():
    g = _ext.ReleaseGate()
    assert g.may_free  # never exported
    g.exported()
    g.opened()
    assert not g.may_free and "still open" in g.why_not
    g.closed(False)
    assert not g.may_free and "without the daemon confirming" in g.why_not
    g.closed(True)
    assert g.may_free


def test_release_gate_names_a_bad_code():
    with pytest.raises(ValueError, match="'NOPE' is not a status code name"):
        _ext.ReleaseGate().open_failed("NOPE")


def _layout(shapes):
    """An independent layout: gradients then updates, 64-byte aligned."""
    def up(n):
        return (n + 63) // 64 * 64

    slots, off = [], 0
    for r, c in shapes:
        slots.append({"rows": r, "cols": c, "gradient_offset": off})
        off += up(r * c * 4)
    for s in slots:
        s["update_offset"] = off
        off += up(s["rows"] * s["cols"] * 4)
    return {"total_bytes": off, "slots": slots}


def test_nccl_order_calls_back_with_each_group():
    shapes = [(random.randint(0, 9), random.randint(1, 9)) for _ in range(6)]
    layout = _layout(shapes)
    groups = []
    order = _ext.NcclOrder(lambda t, stream: groups.append((t, stream)), 5, layout)
    base, stream = 1 << 20, 77
    order.warm_up(4096, stream)
    ids = random.sample(range(6), 6)
    order.send_gradients(base, ids, stream)
    order.receive_updates(base, ids[::-1], stream)
    assert groups[0] == ([(True, 5, 4096, 1), (False, 5, 4100, 1)], stream)
    s = layout["slots"]
    want_send = [(True, 5, base + s[i]["gradient_offset"], shapes[i][0] * shapes[i][1])
                 for i in ids if shapes[i][0]]
    want_recv = [(False, 5, base + s[i]["update_offset"], shapes[i][0] * shapes[i][1])
                 for i in ids[::-1] if shapes[i][0]]
    assert groups[1] == (want_send, stream)
    assert groups[2] == (want_recv, stream)


def test_nccl_order_refuses_a_bad_index_before_any_group():
    groups = []
    order = _ext.NcclOrder(lambda t, s: groups.append(t), 1, _layout([(2, 3)]))
    with pytest.raises(_ext.InvalidArgumentError, match="parameter index 1 is outside"):
        order.send_gradients(0, [0, 1], 0)
    assert groups == []


def test_nccl_order_refuses_a_layout_whose_bytes_disagree():
    layout = _layout([(2, 3)])
    layout["slots"][0]["bytes"] = 20
    with pytest.raises(ValueError, match="bytes 20 is not rows x cols x 4 = 24"):
        _ext.NcclOrder(lambda t, s: None, 1, layout)


def test_nccl_order_passes_the_callbacks_exception_through():
    class Boom(Exception):
        pass

    def group(transfers, stream):
        raise Boom("ncclGroupEnd failed")

    order = _ext.NcclOrder(group, 1, _layout([(2, 3)]))
    with pytest.raises(Boom, match="ncclGroupEnd failed"):
        order.send_gradients(0, [0], 0)

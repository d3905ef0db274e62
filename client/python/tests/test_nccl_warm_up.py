"""The nccl region's NCCL calls in order (_gpu.NcclRegion; transport/nccl.h):
right after ncclCommInitRank the warm-up group (one fp32 sent to dmuond, one
received from it), before any step's group; then one send group per
declaration and one receive group per announcement, slots of no elements left
out. NCCL and the GPU memory are replaced by recorders on the CPU (no GPU
needed): the calls are the shipped code's, only their targets are fake."""

import contextlib
import ctypes
import random

import pytest
import torch

from dmuon import _gpu

DAEMON_RANK = 2


class _Recorder:
    """_Lib's surface as NcclRegion uses it, recording each call."""

    calls = []

    def __init__(self, stem, fallback, what):
        self.lib = self
        _Recorder.calls = self.calls = []

    def check(self, name, *args):
        self.calls.append((name, args))

    def ncclCommAbort(self, comm):
        self.calls.append(("ncclCommAbort", (comm,)))


class _HostBuffer:
    """_DeviceBuffer on host memory."""

    def __init__(self, nbytes, device):
        self.tensor = torch.zeros(max(int(nbytes), 64), dtype=torch.uint8)

    def free(self):
        self.tensor = None


class _Stream:
    cuda_stream = 0


# A fresh id each run (no NUL byte, which a c_char view would cut at).
UNIQUE_ID = bytes(random.randrange(1, 256) for _ in range(128))


class _Session:
    def nccl(self):
        return {"unique_id": UNIQUE_ID, "nranks": DAEMON_RANK + 1,
                "daemon_rank": DAEMON_RANK}


# Parameter 0: 2x3; parameter 1: none of it on this rank (0x0).
LAYOUT = {"total_bytes": 256, "slots": [
    {"rows": 2, "cols": 3, "gradient_offset": 0, "update_offset": 128},
    {"rows": 0, "cols": 0, "gradient_offset": 64, "update_offset": 192},
]}


@pytest.fixture
def region(monkeypatch):
    monkeypatch.setattr(_gpu, "_Lib", _Recorder)
    monkeypatch.setattr(_gpu, "_DeviceBuffer", _HostBuffer)
    monkeypatch.setattr(_gpu.torch.cuda, "device",
                        lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_gpu.torch.cuda, "current_stream",
                        lambda device=None: _Stream())
    r = _gpu.NcclRegion(LAYOUT, "cpu")
    yield r
    r.close()


def _names(calls):
    return [name for name, _ in calls]


def _transfer(call):
    """(name, data pointer, count, peer) of an ncclSend/ncclRecv call."""
    name, (ptr, count, dtype, peer, comm, stream) = call
    assert dtype.value == 7  # ncclFloat32
    return name, ptr.value, count.value, peer.value


def test_the_warm_up_is_the_first_group_right_after_joining(region):
    region.join(_Session(), 1)
    calls = _Recorder.calls
    assert _names(calls) == ["ncclCommInitRank", "ncclGroupStart", "ncclSend",
                             "ncclRecv", "ncclGroupEnd"]
    init = calls[0][1]
    assert init[1].value == DAEMON_RANK + 1 and init[3].value == 1
    # The session's id itself, in the struct's own memory.
    assert bytes(init[2]) == UNIQUE_ID
    send, recv = _transfer(calls[2]), _transfer(calls[3])
    assert send[2:] == (1, DAEMON_RANK) and recv[2:] == (1, DAEMON_RANK)
    assert send[1] != recv[1], "the two fp32s are distinct memory"


def test_steps_come_after_the_warm_up_and_skip_empty_slots(region):
    region.join(_Session(), 1)
    warm_up = len(_Recorder.calls)
    region.handed([1, 0])
    region.receive([0, 1])
    steps = _Recorder.calls[warm_up:]
    assert _names(steps) == ["ncclGroupStart", "ncclSend", "ncclGroupEnd",
                             "ncclGroupStart", "ncclRecv", "ncclGroupEnd"]
    grad = region.grad[0].data_ptr()
    upd = region.upd[0].data_ptr()
    assert _transfer(steps[1]) == ("ncclSend", grad, 6, DAEMON_RANK)
    assert _transfer(steps[4]) == ("ncclRecv", upd, 6, DAEMON_RANK)
    # A declaration of only empty slots is an empty group, as in C++.
    region.handed([1])
    assert _names(_Recorder.calls[-2:]) == ["ncclGroupStart", "ncclGroupEnd"]


def test_close_aborts_the_communicator(region):
    region.join(_Session(), 0)
    region.comm = ctypes.c_void_p(1)  # what ncclCommInitRank would set
    region.close()
    assert _Recorder.calls[-1][0] == "ncclCommAbort"
    assert region.warm_up is None

"""The GPU transports at the native layer (dmuon._dmuon): region_layout(),
open_session(transport="cuda_ipc"/"nccl"), Session.layout()/nccl()/
next_announced(). Without a GPU: the layout against an independent
computation, a CPU dmuond's refusal, and a cuda_ipc step against
fake_gpu_dmuond, the test double whose "GPU memory" is a POSIX shm segment
of this process (bazel build //tests:fake_gpu_dmuond)."""

import os
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

import dmuon
from dmuon import _gpu, _native
from helpers import lr_scale, newton_schulz

PARAMS = [
    ("a", 40, 24),
    dict(name="b", rows=48, cols=24, sharding="rows", row_begin=16, row_end=48),
    dict(name="c", rows=7, cols=5, sharding="unreduced"),
    ("d", 3, 3),
]


def independent_layout(params):
    """transport/transport.h: this rank's view of each parameter (its rows
    when row-sharded), fp32; every gradient slot, then every update slot, each
    starting at a multiple of 64 bytes; total = the end rounded up to 64."""
    views = []
    for p in params:
        if isinstance(p, dict):
            rows = p["row_end"] - p["row_begin"] if p.get("sharding") == "rows" else p["rows"]
            views.append((rows, p["cols"]))
        else:
            views.append((p[1], p[2]))
    align = lambda x: (x + 63) // 64 * 64  # noqa: E731
    slots = [dict(rows=r, cols=c, bytes=r * c * 4) for r, c in views]
    cursor = 0
    for key in ("gradient_offset", "update_offset"):
        for s in slots:
            s[key] = cursor
            cursor = align(cursor + s["bytes"])
    return dict(total_bytes=cursor, slots=slots)


def test_region_layout_matches_an_independent_computation():
    got = dmuon._ext.region_layout(PARAMS, rank=1, world_size=2)
    assert got == independent_layout(PARAMS)
    assert dmuon._ext.region_layout(PARAMS) == got  # the rows come from PARAMS
    assert all(s["gradient_offset"] % 64 == 0 and s["update_offset"] % 64 == 0
               for s in got["slots"])


def test_region_layout_names_a_bad_parameter():
    with pytest.raises(dmuon.InvalidArgumentError, match="'b'"):
        dmuon._ext.region_layout(
            [dict(name="b", rows=4, cols=4, sharding="rows", row_begin=2, row_end=9)]
        )
    with pytest.raises(dmuon.InvalidArgumentError, match="rank 2"):
        dmuon._ext.region_layout(PARAMS, rank=2, world_size=2)


def test_region_layout_of_blocks():
    """sharding='blocks': this rank's view is (sum of its row runs' lengths,
    sum of its column runs'), in any order; both lists empty: 0x0, 0 bytes."""
    params = [
        ("a", 40, 24),
        dict(name="w", rows=6, cols=9, sharding="blocks", row_runs=[(3, 6), (0, 1)],
             col_runs=[(7, 9), (0, 2)]),
        dict(name="none", rows=5, cols=5, sharding="blocks", row_runs=[], col_runs=[]),
        ("d", 3, 3),
    ]
    got = dmuon._ext.region_layout(params, rank=1, world_size=2)
    views = [("a", 40, 24), ("w", 4, 4), ("none", 0, 0), ("d", 3, 3)]
    assert got == independent_layout(views)
    assert got["slots"][2]["bytes"] == 0


def test_region_layout_names_bad_blocks():
    def blocks(**kw):
        return [dict(name="w", rows=6, cols=9, sharding="blocks", **kw)]

    with pytest.raises(dmuon.InvalidArgumentError, match="'w'.*row run \\[4,7\\)"):
        dmuon._ext.region_layout(blocks(row_runs=[(4, 7)], col_runs=[(0, 9)]))
    with pytest.raises(dmuon.InvalidArgumentError, match="'w'.*both lists are empty"):
        dmuon._ext.region_layout(blocks(row_runs=[(0, 6)], col_runs=[]))
    with pytest.raises(dmuon.InvalidArgumentError, match="'w'.*\\(begin, end\\) pairs"):
        dmuon._ext.region_layout(blocks(row_runs=[(0, 1, 2)], col_runs=[(0, 9)]))
    with pytest.raises(dmuon.InvalidArgumentError,
                       match="replicated, rows, unreduced, blocks"):
        dmuon._ext.region_layout([dict(name="w", rows=6, cols=9, sharding="cols")])


def test_unknown_transport_lists_the_choices(daemon):
    c = dmuon.Client(daemon.address)
    with pytest.raises(dmuon.InvalidArgumentError, match="cuda_ipc, nccl"):
        c.open_session("t", [("w", 8, 8)], transport="gpu")


def test_cpu_dmuond_rejects_cuda_ipc_naming_it(daemon):
    c = dmuon.Client(daemon.address)
    total = dmuon._ext.region_layout(PARAMS)["total_bytes"]
    export = dict(mem_handle=b"\1" * 64, offset=0, bytes=total,
                  event_handle=b"", device_uuid=b"\2" * 16)
    for transport in ("cuda_ipc", "nccl"):
        with pytest.raises(dmuon.Error) as e:
            c.open_session("gpu-on-cpu", PARAMS, transport=transport, cuda_ipc=export)
        assert e.value.code == "UNIMPLEMENTED"
        assert transport in str(e.value) and daemon.address in str(e.value)


def fake_gpu_dmuond():
    root = _native.checkout_root()
    path = os.path.join(root or "", "bazel-bin", "tests", "fake_gpu_dmuond")
    if not os.access(path, os.X_OK):
        pytest.skip(f"{path} is not built (bazel build //tests:fake_gpu_dmuond)")
    return path


def released_line(daemon, seg_name):
    """fake_gpu_dmuond's log line for the release of the cuda_ipc region in
    shm segment `seg_name` (None before the release): it closed its mapping,
    and says whether the client's segment was still there then."""
    with open(daemon.log_path, errors="replace") as f:
        for line in f:
            if f"released cuda_ipc region shm:/{seg_name};" in line:
                return line.strip()
    return None


def test_cuda_ipc_step_on_the_fake_gpu_daemon():
    d = dmuon.LocalDaemon(binary=fake_gpu_dmuond(), stop_grace=1.0)
    params = [("a", 40, 24), ("b", 24, 40), ("c", 32, 32)]
    layout = dmuon._ext.region_layout(params)
    seg = shared_memory.SharedMemory(create=True, size=layout["total_bytes"])
    try:
        c = dmuon.Client(d.address)
        s = c.open_session(
            "fake-gpu", params, transport="cuda_ipc",
            cuda_ipc=dict(mem_handle=b"shm:/" + seg.name.encode(), offset=0,
                          bytes=layout["total_bytes"]))
        assert s.transport == "cuda_ipc" and s.layout() == layout
        assert s.nccl()["nranks"] == 0
        with pytest.raises(dmuon.FailedPreconditionError, match="GPU region"):
            s.gradient(0)

        def view(slot, key):  # a slot of the "GPU" region
            return np.ndarray((slot["rows"], slot["cols"]), np.float32,
                              buffer=seg.buf, offset=slot[key])

        gen = torch.Generator().manual_seed(3)
        momentum = [torch.zeros(r, c_) for _, r, c_ in params]
        for step in (1, 2):
            grads = [torch.randn(r, c_, generator=gen) for _, r, c_ in params]
            for slot, g in zip(layout["slots"], grads):
                view(slot, "gradient_offset")[:] = g.numpy()
            s.gradients_ready([2, 1])
            s.gradient_ready(0)
            seen = []
            while True:
                ids = s.next_announced()
                if not ids:
                    break
                seen += ids
            assert sorted(seen) == [0, 1, 2]
            s.finish_step()
            for i, ((_, r, c_), g) in enumerate(zip(params, grads)):
                m = momentum[i]
                m.mul_(0.95).add_(0.05 * g)
                want = newton_schulz(0.05 * g + 0.95 * m) * lr_scale(r, c_, None)
                got = torch.from_numpy(view(layout["slots"][i], "update_offset").copy())
                assert ((got - want).norm() / want.norm()).item() < 1e-4, (step, i)
        assert not s.region_released
        assert released_line(d, seg.name) is None  # mapped while open
        # close() answers once the daemon released the region: the segment
        # (the "GPU memory") is still there when it does.
        s.close()
        assert s.region_released
        assert "segment is still there" in released_line(d, seg.name)
    finally:
        seg.close()
        seg.unlink()
        d.stop()


class ShmRegion(_gpu.Region):
    """The stand-in for dmuon._gpu.CudaIpcRegion: the region is a POSIX shm
    segment fake_gpu_dmuond maps as "GPU memory"; it records which ids were
    handed (after their gradients were written) so the test can check the
    order DMuon follows: copy, then handed(), then declare."""

    kind = "cuda_ipc"
    mapped_by_daemon = True
    made = []
    daemon = None  # the fake_gpu_dmuond, whose log says when it released us

    def __init__(self, layout, device):
        self.layout = layout
        self.seg = shared_memory.SharedMemory(create=True, size=layout["total_bytes"])
        flat = torch.frombuffer(self.seg.buf, dtype=torch.uint8)
        self.grad, self.upd = _gpu._views(flat, layout)
        self.handed_ids, self.closed, self.kept = [], False, None
        self.released_before_free = None
        ShmRegion.made.append(self)

    def export(self):
        return dict(mem_handle=b"shm:/" + self.seg.name.encode(), offset=0,
                    bytes=self.layout["total_bytes"], event_handle=b"",
                    device_uuid=b"")

    def handed(self, ids):
        self.handed_ids += ids

    def close(self):  # frees the "GPU memory"
        if not self.closed:
            self.closed = True
            self.released_before_free = released_line(self.daemon, self.seg.name) is not None
            self.grad = self.upd = None
            self.seg.close()
            self.seg.unlink()

    def keep(self, why):  # kept, as CudaIpcRegion would be (unlinked anyway here)
        self.kept = why
        self.grad = self.upd = None
        self.seg.close()
        self.seg.unlink()


def test_dmuon_over_cuda_ipc_matches_the_reference(monkeypatch):
    """DMuon's GPU-transport path (region exported at open, updates read in
    place from the region) against the fp32 reference Muon, with host memory
    standing in for the GPU region and fake_gpu_dmuond for dmuond_cuda."""
    import copy

    from dmuon.optim import DMuon
    from helpers import ReferenceMuon, TinyLM, lm_batch, max_rel_err, muon_split, train

    monkeypatch.setattr(_gpu, "new_region",
                        lambda kind, layout, device: ShmRegion(layout, device))
    monkeypatch.setattr(_gpu, "choose", lambda transport, device, address: "cuda_ipc")
    ShmRegion.made = []
    d = dmuon.LocalDaemon(binary=fake_gpu_dmuond(), stop_grace=1.0)
    ShmRegion.daemon = d
    try:
        torch.manual_seed(0)
        ref_model = TinyLM()
        dm_model = copy.deepcopy(ref_model)
        hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
        mats, others = muon_split(ref_model, [ref_model.head])
        ref = ReferenceMuon(mats, others, adamw_lr=3e-3, **hyper)
        opt = DMuon(dm_model, server=d.address, adamw_lr=3e-3, adamw=[dm_model.head],
                    transport="cuda_ipc", **hyper)
        assert opt.transport == "cuda_ipc"
        assert "transport to dmuond: cuda_ipc" in opt.routing_table
        (region,) = ShmRegion.made
        n = len(opt._table.muon)
        ref_l = train(ref_model, ref, 6, lm_batch)
        dm_l = train(dm_model, opt, 6, lm_batch)
        # Every Muon gradient was handed over once per step, each right before
        # it was declared (handed() follows the copy into the region).
        assert sorted(region.handed_ids) == sorted(list(range(n)) * 6)
        assert max_rel_err(dm_model, ref_model) < 1e-5
        assert max(abs(a - b) / abs(b) for a, b in zip(dm_l, ref_l)) < 1e-5
        # The end in order: the session closes, the daemon releases the region
        # (its mapping of the "GPU memory"), and only then is the memory freed.
        opt.close()
        assert region.closed and region.kept is None
        assert region.released_before_free, "freed before dmuond released the region"
        assert "segment is still there" in released_line(d, region.seg.name)
    finally:
        d.stop()


def test_dmuon_keeps_cuda_ipc_memory_the_daemon_did_not_release(monkeypatch):
    """A daemon that cannot confirm the release (gone when DMuon closes; not a
    private one, whose exit DMuon could wait for): the memory is kept, not
    freed under a mapping that may still exist."""
    from dmuon.optim import DMuon
    from helpers import TinyLM

    monkeypatch.setattr(_gpu, "new_region",
                        lambda kind, layout, device: ShmRegion(layout, device))
    monkeypatch.setattr(_gpu, "choose", lambda transport, device, address: "cuda_ipc")
    ShmRegion.made = []
    d = dmuon.LocalDaemon(binary=fake_gpu_dmuond(), stop_grace=1.0)
    ShmRegion.daemon = d
    try:
        model = TinyLM()
        opt = DMuon(model, server=d.address, adamw=[model.head], transport="cuda_ipc",
                    timeout=5)
        (region,) = ShmRegion.made
    finally:
        d.stop()
    opt.close()
    assert not region.closed
    assert "closing the session failed" in region.kept


def test_gpu_transport_with_cpu_tensors_is_refused(daemon):
    from dmuon.optim import DMuon
    from helpers import TinyLM

    with pytest.raises(ValueError, match=r"DaemonOptions\(transport='nccl'\) needs the Muon parameters "
                                         "on a CUDA device"):
        DMuon(TinyLM(), server=daemon.address, transport="nccl")


def test_choose_picks_cuda_ipc_on_this_host_and_nccl_elsewhere():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert _gpu.choose("auto", cuda, "127.0.0.1:5000") == "cuda_ipc"
    assert _gpu.choose("auto", cuda, "localhost:5000") == "cuda_ipc"
    assert _gpu.choose("auto", cuda, "unix:/tmp/d.sock") == "cuda_ipc"
    assert _gpu.choose("auto", cuda, "192.0.2.7:5000") == "nccl"  # TEST-NET-1
    assert _gpu.choose("auto", cpu, "192.0.2.7:5000") == "auto"
    assert _gpu.choose("shm", cuda, "127.0.0.1:5000") == "shm"  # staged, as asked

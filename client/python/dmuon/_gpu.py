"""DMuon's GPU transports: CUDA tensors go to dmuond without host staging.

The daemon lays a session's tensors out in one region (fp32 gradient and
update slots, 64-byte aligned: `_native.region_layout`). For CUDA tensors
that region is GPU memory of this process, allocated here with cudaMalloc
(not torch's caching allocator: CUDA IPC exports whole allocations, and an
allocator with expandable segments cannot export at all) and wrapped as one
uint8 tensor through __cuda_array_interface__:

  cuda_ipc (dmuond on this host): the allocation is exported with
    cudaIpcGetMemHandle and an interprocess event at OpenSession. A gradient
    is copied into its slot on torch's current stream, the event is recorded
    after it, then the gradient is declared: the daemon waits on the event,
    reads in place and writes the update in place, synchronized before it
    announces the update.
  nccl (dmuond anywhere): the rank joins the job's communicator (unique id
    from OpenSession; trainer rank r is NCCL rank r, the daemon the last
    rank) and posts the warm-up right away, its first group: one fp32 sent
    to and one received from dmuond, which connects both directions before
    any step (NCCL connects lazily, in the first group end that uses a
    pair, and that group end waits for the peer: without it the first
    gradient group would wait for a receive dmuond posts only after the
    declaration). A gradient is sent with ncclSend (one group per
    declaration) on torch's current stream, then declared; once a step's
    gradients are all declared, the updates are received in the order
    dmuond announces them (one ncclRecv group per announcement). Slots of
    no elements (a rank holding nothing of a matrix) move nothing either
    way: transport/nccl.h's order.

The end keeps an order (_session.release): the session is closed first, and
cuda_ipc memory is freed only once dmuond confirmed it released the region
(Session.region_released: no computation uses it, the IPC mapping is
closed), or once the private daemon that mapped it has exited. Otherwise it
is kept (Region.keep; the driver frees it when the process exits) rather
than freed under the daemon's mapping.

The rules are the C++ client's, bound from client/cuda/ (one implementation
for C++ and Python trainers, tested there): when exported memory may be
freed is a _dmuon.ReleaseGate (release_gate.h), which groups an nccl rank
posts and in what order is a _dmuon.NcclOrder (nccl_order.h) that calls
back into NcclRegion._group for the NCCL calls.

CUDA and NCCL are reached through ctypes on the libraries torch itself
loaded (libcudart, libnccl), so the extension links neither. Nothing here
runs without a GPU; the logic around it (what is exported, when events are
recorded, the receive order) is the same code a host-memory stand-in drives
in client/python/tests/test_gpu_transports.py against a fake GPU daemon.
"""

import ctypes
import os

import torch

from . import _native

def is_local(address):
    """True when `address` (host:port or unix:path) is this host, by the C++
    client's rule (the one that picks shm): Client::IsLocalAddress."""
    return _native.load().is_local_address(address)


def choose(transport, device, address):
    """The transport for Muon parameters on `device` (a torch.device):
    "cuda_ipc" | "nccl" for CUDA tensors (same host: cuda_ipc), the user's
    choice otherwise. Raises ValueError for a GPU transport with CPU tensors."""
    if transport in ("cuda_ipc", "nccl"):
        if device.type != "cuda":
            raise ValueError(f"DMuon: DaemonOptions(transport='{transport}') needs the Muon "
                             f"parameters on a CUDA device; they are on {device}")
        return transport
    if transport == "auto" and device.type == "cuda":
        return "cuda_ipc" if address is None or is_local(address) else "nccl"
    return transport


def _loaded(stem):
    """The path of a library this process already mapped (torch's own)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith(stem):
                    return path
    except OSError:
        pass
    return None


class _Lib:
    """A CUDA-family library by ctypes with one error check per library."""

    def __init__(self, stem, fallback, what):
        torch.cuda.init()
        path = _loaded(stem) or fallback
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as e:
            raise RuntimeError(f"DMuon: cannot load {what} ({path}): {e}") from e
        self.what = what

    def check(self, name, *args):
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"DMuon: {name} failed with {self.what} error {rc}"
                               f"{self._describe(rc)}")

    def _describe(self, rc):
        for fn in ("cudaGetErrorString", "ncclGetErrorString"):
            f = getattr(self.lib, fn, None)
            if f is not None:
                f.restype = ctypes.c_char_p
                return f" ({f(rc).decode(errors='replace')})"
        return ""


_cudart = None


def cudart():
    global _cudart
    if _cudart is None:
        _cudart = _Lib("libcudart", "libcudart.so", "the CUDA runtime")
    return _cudart


class _DeviceBuffer:
    """cudaMalloc'ed bytes on the current device, seen by torch as a uint8
    tensor (zero copy, through __cuda_array_interface__)."""

    def __init__(self, nbytes, device):
        # At least one aligned block: a rank holding nothing of every matrix
        # (SHARDING_BLOCKS) has a 0-byte layout, and cudaMalloc(0) gives no
        # pointer to export (cuda_ipc) or to hand to torch.
        nbytes = max(int(nbytes), 64)
        self.rt, self.ptr = cudart(), ctypes.c_void_p()
        with torch.cuda.device(device):
            self.rt.check("cudaMalloc", ctypes.byref(self.ptr), ctypes.c_size_t(nbytes))
            self.rt.check("cudaMemset", self.ptr, 0, ctypes.c_size_t(nbytes))
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (self.ptr.value, False),
            "version": 2, "strides": None}
        self.tensor = torch.as_tensor(self, device=device)

    def free(self):
        if self.ptr:
            torch.cuda.synchronize(self.tensor.device)
            self.tensor = None
            self.rt.check("cudaFree", self.ptr)
            self.ptr = ctypes.c_void_p()


def _views(flat, layout):
    grads, upds = [], []
    for s in layout["slots"]:
        shape = (s["rows"], s["cols"])
        n = s["rows"] * s["cols"] * 4
        grads.append(flat[s["gradient_offset"]:s["gradient_offset"] + n]
                     .view(torch.float32).view(shape))
        upds.append(flat[s["update_offset"]:s["update_offset"] + n]
                    .view(torch.float32).view(shape))
    return grads, upds


class Region:
    """What DMuon needs of a session's region, whatever moves it:
    grad[i] / upd[i] tensors; export() before OpenSession (cuda_ipc);
    join(session, rank) after it (nccl); handed(ids) after writing gradients
    and before declaring them; receive(ids) per announcement (nccl); at the
    end close() (free it) or, when the daemon may still map it, keep(why).
    mapped_by_daemon: the daemon maps this memory (cuda_ipc), so it is freed
    only after the daemon released the session's region."""

    kind = None
    mapped_by_daemon = False
    grad = upd = ()
    _gate = None

    @property
    def gate(self):
        """When memory the daemon maps may be freed: _dmuon.ReleaseGate, the
        C++ client's own rule (client/cuda/release_gate.h), which _session
        tells of the export, the open and the close."""
        if self._gate is None:
            self._gate = _native.load().ReleaseGate()
        return self._gate

    def export(self):
        return None

    def join(self, session, rank):
        pass

    def handed(self, ids):
        pass

    def receive(self, ids):
        pass

    def close(self):
        pass

    def keep(self, why):
        """Drops the views but not the memory (the daemon may still map it)."""
        self.grad = self.upd = ()


class _GpuRegion(Region):
    """The region in this process's GPU memory, as slot views."""

    def __init__(self, layout, device):
        self.device = torch.device(device)
        self.layout = layout
        self.bytes = layout["total_bytes"]
        self.buf = _DeviceBuffer(self.bytes, self.device)
        self.grad, self.upd = _views(self.buf.tensor, layout)

    def base(self):
        """The region's address."""
        return self.buf.tensor.data_ptr()

    def close(self):
        self.grad = self.upd = ()
        self.buf.free()

    def keep(self, why):
        import warnings

        self.grad = self.upd = ()
        _kept.append(self.buf)  # never freed: released with the process
        self.buf = None
        warnings.warn(f"DMuon: {self.bytes} bytes of {self.kind} GPU memory kept "
                      f"until the process exits, not freed: {why}", RuntimeWarning,
                      stacklevel=2)


_kept = []  # GPU buffers a daemon may still map (Region.keep)


class CudaIpcRegion(_GpuRegion):
    kind = "cuda_ipc"
    mapped_by_daemon = True

    def __init__(self, layout, device):
        super().__init__(layout, device)
        with torch.cuda.device(self.device):
            self.event = torch.cuda.Event(enable_timing=False, interprocess=True)
            # Every record is made on this one stream, after it waited for the
            # stream that wrote the gradient, so the event's latest record
            # covers every gradient written so far, whichever stream wrote it
            # (the daemon waits on the latest record only).
            self.stream = torch.cuda.Stream(self.device)
            self.event.record(self.stream)  # an IPC handle needs one record

    def export(self):
        rt = cudart()
        handle = (ctypes.c_char * 64)()
        rt.check("cudaIpcGetMemHandle", ctypes.byref(handle), self.buf.ptr)
        return dict(mem_handle=bytes(handle), offset=0, bytes=self.bytes,
                    event_handle=bytes(self.event.ipc_handle()),
                    device_uuid=device_uuid(self.device))

    def handed(self, ids):
        # After the copies into the slots, made on the current stream (in a
        # backward hook: the stream autograd set for that node).
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.event.record(self.stream)


def device_uuid(device):
    """cudaDeviceProp.uuid: 16 bytes after the 256-byte name."""
    rt = cudart()
    props = ctypes.create_string_buffer(8192)  # larger than any cudaDeviceProp
    fn = "cudaGetDeviceProperties_v2" if hasattr(
        rt.lib, "cudaGetDeviceProperties_v2") else "cudaGetDeviceProperties"
    rt.check(fn, props, ctypes.c_int(device.index or 0))
    return props.raw[256:272]


class _NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


_NCCL_FLOAT32 = 7  # ncclFloat32
_NCCL_CALL = {True: "ncclSend", False: "ncclRecv"}


class NcclRegion(_GpuRegion):
    """Which groups are posted, in what order, is the C++ client's rule
    (_dmuon.NcclOrder: client/cuda/nccl_order.h, tested there against the
    daemon's side); this class makes its NCCL calls."""

    kind = "nccl"

    def __init__(self, layout, device):
        super().__init__(layout, device)
        self.nccl = _Lib("libnccl", "libnccl.so.2", "NCCL")
        self.comm = ctypes.c_void_p()
        self.order = None
        self.warm_up = None  # the warm-up's send and receive fp32s

    def join(self, session, rank):
        info = session.nccl()
        if len(info["unique_id"]) != 128:
            raise RuntimeError("DMuon: dmuond returned no NCCL unique id")
        # A copy into the struct's own memory: reading uid.internal gives a
        # bytes copy (a c_char array field), and writing through it would
        # write over that object instead of the id.
        uid = _NcclUniqueId.from_buffer_copy(bytes(info["unique_id"]))
        with torch.cuda.device(self.device):
            # Blocks until every rank and dmuond (which joins when the job's
            # first session opens) have joined.
            self.nccl.check("ncclCommInitRank", ctypes.byref(self.comm),
                            ctypes.c_int(info["nranks"]), uid, ctypes.c_int(rank))
            self.order = _native.load().NcclOrder(self._group, info["daemon_rank"],
                                                  self.layout)
            # The communicator's first group, before any step's (dmuond posts
            # its side as soon as the communicator is initialized). Returns
            # once both directions are connected.
            self.warm_up = torch.zeros(2, dtype=torch.float32, device=self.device)
            self.order.warm_up(self.warm_up.data_ptr(), self._stream())

    def _stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream

    def _group(self, transfers, stream):
        """NcclOrder's communicator: one ncclGroupStart/End group of
        (send, peer, address, count fp32) transfers on `stream`."""
        self.nccl.check("ncclGroupStart")
        first = None
        for send, peer, address, count in transfers:
            try:
                self.nccl.check(_NCCL_CALL[send], ctypes.c_void_p(address),
                                ctypes.c_size_t(count), ctypes.c_int(_NCCL_FLOAT32),
                                ctypes.c_int(peer), self.comm, ctypes.c_void_p(stream))
            except RuntimeError as e:
                first = first or e
        self.nccl.check("ncclGroupEnd")
        if first is not None:
            raise first

    def handed(self, ids):
        self.order.send_gradients(self.base(), list(ids), self._stream())

    def receive(self, ids):
        self.order.receive_updates(self.base(), list(ids), self._stream())

    def close(self):
        if self.comm:
            self.nccl.lib.ncclCommAbort(self.comm)
            self.comm = ctypes.c_void_p()
        self.order = self.warm_up = None
        super().close()


_KINDS = {"cuda_ipc": CudaIpcRegion, "nccl": NcclRegion}


def new_region(kind, layout, device):
    """The region for `kind` ("cuda_ipc" | "nccl"); tests replace this."""
    return _KINDS[kind](layout, device)

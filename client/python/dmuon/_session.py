"""Opening DMuon's dmuond session: the daemon (a private one for
server="auto", started by rank 0), the job id the ranks agree on, a pool's
split of the table (planned once, by rank 0, and sent to every rank), and a
collective check that every rank got its session."""

import ipaddress
import os
import socket
import sys
import warnings
import weakref

import torch

from . import _ddp, _gpu, _native, _trace
from ._daemon import LocalDaemon

_ext = _native.load()


def private_flags(flags, world):
    """A private daemon's flags: unless told otherwise, it computes on the cores
    this host's trainers leave free (all ranks' torch threads), else on as
    many threads as one trainer uses (what in-process Muon would use).
    DMUON_TRACE=FILE: it writes its side of the step timeline beside FILE
    (dmuon/_trace.py daemon_trace_path)."""
    flags = list(flags)
    if os.environ.get("DMUON_TRACE") and not any(
            f.startswith("--trace-file") for f in flags):
        flags.append("--trace-file=" + _trace.daemon_trace_path(os.environ["DMUON_TRACE"]))
    if not any(f.startswith("--cpu-threads") for f in flags):
        import torch

        mine = torch.get_num_threads()
        free = (os.cpu_count() or 1) - mine * world
        flags.append(f"--cpu-threads={free if free >= 1 else mine}")
    return flags


ENV = "DMUON_SERVER"


def server_from_env(value):
    """$DMUON_SERVER as a `server`: "host:port" (one daemon), "a:p,b:q" (a
    pool), or "name:port" whose name resolves to several addresses (a pool of
    one daemon per address: the IPv4 ones, else the IPv6 ones, sorted, so
    every rank and every run lists them alike; a name with one address per
    family, such as localhost, stays one daemon)."""
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"DMuon: ${ENV}={value!r} is empty; unset it for a private "
                         "dmuond, or set it to host:port or a comma list of them")
    for p in parts:
        try:
            _ext.check_address(p)
        except ValueError as e:
            raise ValueError(f"DMuon: ${ENV}={value!r}: {e}; set it to host:port "
                             "(or a comma list of them), or unset it for a "
                             "private dmuond") from None
    if len(parts) > 1:
        return parts
    address = parts[0]
    host, sep, port = address.rpartition(":")
    if address.startswith("unix:") or not sep or not port.isdigit():
        return address  # unix sockets, gRPC target syntax: as given
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(host)
        return address
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError:
        return address  # connecting reports it, naming the address
    by_family = {}
    for family, *_, sockaddr in infos:
        by_family.setdefault(family, set()).add(sockaddr[0])
    ips = sorted(by_family.get(socket.AF_INET) or by_family.get(socket.AF_INET6) or ())
    if len(ips) <= 1:
        return address
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


_warned_cuda = False


def warn_cuda_staged(device, note, address):
    """Once per process, loudly: CUDA parameters, and the daemon reached (a
    private CPU dmuond, or one without GPU transports) makes every step stage
    them through host memory and orthogonalize on CPUs."""
    global _warned_cuda
    if _warned_cuda or device is None or device.type != "cuda" or not note:
        return
    _warned_cuda = True
    msg = (f"DMuon: the Muon parameters are on {device}, but no GPU dmuond is "
           f"reachable ({note}; dmuond at {address}): every step copies them "
           "through host memory and runs Newton-Schulz on CPU cores, far slower "
           "than on the GPU. Run a GPU dmuond, dmuond_cuda (built from source with "
           "`bazel build --config=cuda //daemon:dmuond_cuda`, or the image of "
           "deploy/docker/Dockerfile: the wheel ships the CPU dmuond only), and set "
           f"${ENV}=host:port (or pass "
           "daemon_options=DaemonOptions(server='host:port')) to use it")
    print("\n" + "!" * 78 + "\n" + msg + "\n" + "!" * 78, file=sys.stderr, flush=True)
    warnings.warn(msg, RuntimeWarning, stacklevel=4)


def plan_pool(client, table, groups):
    """A pool's split of `table`: the daemon of each parameter, planned over
    every (daemon, device) slot from the daemons' device counts as they answer
    now. Each rank asking on its own could see different counts (an executor's
    health changing in between) and split the table differently, so rank 0
    plans and broadcasts the result (open_session)."""
    return list(_ext.plan_pool(table, client.device_counts(), groups))


def no_fallback(kind, reason, warn=True):
    """open_session's `fallback` when none is given: takes it silently."""


def _open(client, address, job_id, table, groups, rank, world, transport, device,
          owner=None, resume="auto", fallback=no_fallback):
    """(session, GPU region or None, why host staging was chosen or None).

    CUDA tensors (device) use a GPU transport (_gpu.choose: cuda_ipc on this
    host, nccl elsewhere); with transport="auto" a daemon that offers none
    (a CPU dmuond answers UNIMPLEMENTED) gets the tensors staged through host
    memory instead, and the reason is returned for the routing table. That
    staging is the fallback "host_staging" (_fallbacks.py): `fallback(kind,
    reason, warn)` is told before the host session opens (in strict mode it
    raises; its warning is warn_cuda_staged's)."""
    def host(kind, note=None):  # a host transport (shm/inline, or auto)
        if note is not None:
            fallback("host_staging", note, warn=False)
        return client.open_session(job_id, table, groups, rank=rank, world_size=world,
                                   transport=kind, pool_owner=owner,
                                   resume=resume), None, note

    if device is not None and not isinstance(address, str) and transport == "auto":
        return host("auto", "CUDA tensors staged through host memory: a pool of "
                            "daemons takes no GPU transport")
    kind = transport if device is None else _gpu.choose(transport, device, address)
    if kind not in ("cuda_ipc", "nccl"):
        return host(kind)
    layout = _ext.region_layout(table, rank=rank, world_size=world)
    region = _gpu.new_region(kind, layout, device)
    session = None
    try:
        exported = region.export()
        if region.mapped_by_daemon:
            region.gate.exported()
        session = client.open_session(job_id, table, groups, rank=rank,
                                      world_size=world, transport=kind,
                                      cuda_ipc=exported, resume=resume)
        if region.mapped_by_daemon:
            region.gate.opened()
        region.join(session, rank)
        return session, region, None
    except _ext.Error as e:
        if session is None:
            release([], region, open_error=e)
        else:
            release([session], region)
        if transport != "auto" or getattr(e, "code", "") != "UNIMPLEMENTED":
            raise
        return host("auto", f"CUDA tensors staged through host memory: dmuond at "
                            f"{address} offers no {kind} transport")
    except BaseException as e:
        if session is None:
            release([], region, open_error=e)
        else:
            release([session], region)
        raise


def doorbell() -> bool:
    """Whether shm sessions ask for the doorbell (docs/protocol.md
    "Doorbell"): yes unless $DMUON_DOORBELL is "0", which keeps declarations
    and updates on the Step stream (a before/after of the doorbell on one
    build: benchmarks/README.md)."""
    value = os.environ.get("DMUON_DOORBELL", "1")
    if value not in ("0", "1"):
        raise ValueError(f"DMUON_DOORBELL={value!r}: expected 0 or 1")
    return value == "1"


def connect(address, timeout, connect_timeout, env):
    """A Client of dmuond at `address`: calls wait `timeout` seconds, the
    connection `connect_timeout`. `env`: $DMUON_SERVER's value when the
    address came from it, named when no daemon answers there."""
    try:
        return _ext.Client(address, deadline=float(timeout),
                           connect_deadline=float(connect_timeout),
                           doorbell=doorbell())
    except _ext.UnavailableError as e:
        if not env:
            raise
        err = _ext.UnavailableError(
            f"DMuon: no dmuond answers at ${ENV}={env!r} (waited "
            f"{connect_timeout:g} s): start dmuond there (dmuond --listen=HOST:PORT), "
            f"fix ${ENV}, or unset it for a private dmuond; if dmuond is still "
            f"starting, raise DaemonOptions(connect_timeout=). ({e})")
        err.code = "UNAVAILABLE"
        raise err from None


def open_session(pg, rank, world, server, job_id, timeout, transport, daemon_flags,
                 table, groups, device=None, resume="auto", connect_timeout=10.0,
                 fallback=no_fallback):
    """Returns (session, GPU region or None, staging note or None, private
    daemon or None, address, job id, pool owner or None). device: the Muon
    parameters' CUDA device, or None (CPU tensors, or tensors on several
    devices). A pool (server a list of addresses): the daemon of each
    parameter, which rank 0 plans and every rank passes as pool_owner.
    resume: Client.open_session's ("fresh", "continue", "replace", "auto"),
    the same on every rank. fallback(kind, reason, warn): told of each
    fallback before it is taken (_fallbacks.Fallbacks.take: counts, warns,
    or raises in strict mode): "private_daemon" on every rank, before any
    collective (every rank reads the same $DMUON_SERVER), "host_staging"."""
    env = os.environ.get(ENV, "") if server == "auto" else ""
    if server == "auto" and not env:
        fallback("private_daemon", f"${ENV} is not set, so DaemonOptions(server="
                 "'auto') starts a private dmuond on rank 0's host, computing on "
                 "the cores the trainers leave free")
    wait = float(min(connect_timeout, timeout))  # for a daemon that should be up
    if env:
        # Rank 0 resolves it; the others get rank 0's answer (the broadcast
        # below), so every rank names the same daemons in the same order.
        server = server_from_env(env) if rank == 0 else None
    daemon, err, address = None, None, server
    pool, owner, client = not isinstance(server, str) and server is not None, None, None
    if server == "auto":
        if world > 1:
            hosts = _ddp.gather(socket.gethostname(), pg, world)
            if len(set(hosts)) > 1:
                raise ValueError(
                    "DMuon: DaemonOptions(server='auto') starts one dmuond on rank "
                    f"0's host, but the ranks run on {sorted(set(hosts))}; start "
                    "dmuond yourself and pass "
                    "daemon_options=DaemonOptions(server='host:port')")
        if rank == 0:
            try:
                daemon = LocalDaemon(flags=private_flags(daemon_flags, world),
                                     stop_grace=1.0)
                address = daemon.address
            except Exception as e:  # noqa: BLE001 - reported on every rank
                err, address = e, None
    if pool and rank == 0:
        try:
            client = connect(address, timeout, wait, env)
            owner = plan_pool(client, table, groups)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            err = e
    if world > 1:
        address, job_id, owner = _ddp.broadcast(
            (address, job_id or _ddp.new_job_id(), owner), pg)
        pool = address is not None and not isinstance(address, str)
    else:
        job_id = job_id or _ddp.new_job_id()
    if err is not None and world == 1:
        raise err
    session = region = note = None
    if pool and owner is None:
        if err is None:
            err = RuntimeError("DMuon: rank 0 could not plan the pool's split of "
                               "the parameters")
    elif address is not None:
        try:
            if client is None:
                client = connect(address, timeout,
                                 float(timeout) if daemon is not None else wait, env)
            session, region, note = _open(client, address, job_id, table, groups, rank,
                                          world, transport, device, owner, resume,
                                          fallback)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            err = e
    elif err is None:
        err = RuntimeError("DMuon: rank 0 could not start dmuond")
    if world > 1:
        report = None if err is None else f"{type(err).__name__}: {err}"
        bad = [(r, m) for r, m in enumerate(_ddp.gather(report, pg, world)) if m]
        if bad and err is None:
            daemon = release([session], region, daemon)
            err = _ext.FailedPreconditionError(
                f"DMuon: rank {bad[0][0]} of job '{job_id}' could not open its "
                f"dmuond session: {bad[0][1]}")
    if err is not None:
        if daemon is not None:
            daemon.stop()
        raise err
    warn_cuda_staged(device, note, address)
    if session.notice:
        # The job starts from zero momentum although dmuond had a snapshot
        # of it, which it could not use: the user must know (their resumed
        # run is not resumed).
        warnings.warn(f"dmuond at {address}: {session.notice}", RuntimeWarning,
                      stacklevel=4)
    return session, region, note, daemon, address, job_id, owner


def release(holder, region, daemon=None, open_error=None):
    """Ends a session in order: closes the session `holder` holds (a list it
    empties), then frees its GPU region. Memory the daemon maps (cuda_ipc) is
    freed when its ReleaseGate (the C++ client's rule) allows it: the daemon
    confirmed it released the region (Session.region_released: no
    computation uses it, the IPC mapping is closed), or never mapped it (an
    OpenSession the daemon answered with an error: `open_error`); or once
    `daemon` (the private one, which mapped it) has exited. Otherwise it is
    kept (Region.keep). Returns `daemon` if it is still running."""
    gate = region.gate if region is not None and region.mapped_by_daemon else None
    detail = ""
    while holder:
        session = holder.pop()
        try:
            session.close()
            released = session.region_released
        except Exception as e:  # noqa: BLE001 - the daemon may be gone already
            released, detail = False, f"closing the session failed ({e}); "
        if gate is not None:
            gate.closed(released)
        del session
    if open_error is not None and gate is not None:
        gate.open_failed(getattr(open_error, "code", None))
    if region is None:
        return daemon
    if gate is not None and not gate.may_free and daemon is not None:
        daemon.stop()  # its mapping ends with it
        daemon = None
    elif gate is not None and not gate.may_free:
        region.keep(detail + gate.why_not)
        return daemon
    region.close()
    return daemon


def close(holder, daemon, region=None):
    """Closes the session `holder` holds, frees its GPU region in the order
    release() keeps, then stops the private daemon."""
    daemon = release(holder, region, daemon)
    if daemon is not None:
        daemon.stop()


def cuda_device(muon, transport):
    """The one CUDA device of the Muon table entries `muon` (a GPU transport
    moves them without host staging), else None."""
    devices = {r.param.device for r in muon}
    if transport in ("cuda_ipc", "nccl") and len(devices) > 1:
        raise ValueError(f"DMuon: DaemonOptions(transport='{transport}') needs every Muon "
                         f"parameter on one CUDA device; they are on "
                         f"{sorted(str(d) for d in devices)}")
    device = next(iter(devices))
    if device.type == "cuda" or transport in ("cuda_ipc", "nccl"):
        return device  # a CPU device with a GPU transport: open_session says so
    return None


class Link:
    """A DMuon's dmuond session and what comes with it: the session's
    gradient and update buffers (grad, upd: one tensor per table entry), the
    GPU region (cuda_ipc, nccl) or None, the note on host staging, the
    private daemon of server="auto", the address, job id and pool owner;
    and the finalizer that closes them when the Link (its optimizer) goes.
    open() again after release() reopens (a rollback, a grown table)."""

    def __init__(self, pg, rank, world, timeout, transport, connect_timeout=10.0):
        self.pg, self.rank, self.world = pg, rank, world
        self.timeout, self.asked = timeout, transport  # asked: transport=
        self.connect_timeout = connect_timeout
        self.session = self.region = self.staging = self.daemon = None
        self.address = self.job_id = self.pool_owner = None
        self.fallback = no_fallback  # the owner's Fallbacks.take
        self.grad = self.upd = None
        self._finalizer = None

    def open(self, server, job_id, flags, table, resume="auto"):
        """Opens a session of MuonTable `table` (its table and specs) at
        `server` (the address, a pool's, or "auto")."""
        (session, self.region, self.staging, daemon, self.address, self.job_id,
         self.pool_owner) = open_session(
            self.pg, self.rank, self.world, server, job_id, self.timeout, self.asked,
            flags, list(table.table), list(table.specs),
            cuda_device(table.muon, self.asked), resume=resume,
            connect_timeout=self.connect_timeout, fallback=self.fallback)
        if self.daemon is None:
            self.daemon = daemon
        self.session = session
        if self.region is not None:  # GPU memory of this process
            self.grad, self.upd = list(self.region.grad), list(self.region.upd)
        else:
            n = len(table.muon)
            self.grad = [torch.from_numpy(session.gradient(i)) for i in range(n)]
            self.upd = [torch.from_numpy(session.update(i, writable=True))
                        for i in range(n)]
        # The finalizer owns the session through a list: close() empties it so
        # the channel is gone before the private daemon is told to stop; the
        # GPU region is freed only after the daemon released it (release():
        # closed with region_released, or the private daemon exited).
        self._finalizer = weakref.finalize(self, close, [session], self.daemon,
                                           self.region)

    def release(self):
        """Closes the session, keeping the daemon (a reopen follows)."""
        self._finalizer.detach()
        old, self.session, self.grad, self.upd = self.session, None, None, None
        release([old], self.region)

    def close(self):
        """Closes the session and stops a private daemon."""
        self.session, self.grad, self.upd, self.region = None, None, None, None
        if self._finalizer is not None:
            self._finalizer()

    @property
    def transport(self):
        """How the Muon tensors travel ("cuda_ipc" | "nccl" | "shm" |
        "inline", with the reason when CUDA tensors are staged through host
        memory); None without a session."""
        if self.session is None:
            return None
        t = self.session.transport
        return f"{t} ({self.staging})" if self.staging else t

    def where(self):
        """The daemon, for the routing summary ("" without a session)."""
        if self.session is None:
            return ""
        who = "private dmuond" if self.daemon is not None else "dmuond"
        return f"{who} at {self.address} ({self.transport}), job '{self.job_id}'"

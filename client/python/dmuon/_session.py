"""Opening DMuon's dmuond session: the daemon (a private one for
server="auto", started by rank 0), the job id the ranks agree on, and a
collective check that every rank got its session."""

import os
import socket

from . import _ddp, _native
from ._daemon import LocalDaemon

_ext = _native.load()


def private_flags(flags, world):
    """A private daemon's flags: unless told otherwise, it computes on the cores
    this host's trainers leave free (all ranks' torch threads), else on as
    many threads as one trainer uses (what in-process Muon would use)."""
    flags = list(flags)
    if not any(f.startswith("--cpu-threads") for f in flags):
        import torch

        mine = torch.get_num_threads()
        free = (os.cpu_count() or 1) - mine * world
        flags.append(f"--cpu-threads={free if free >= 1 else mine}")
    return flags


def open_session(pg, rank, world, server, job_id, timeout, transport, daemon_flags,
                 table, groups):
    """Returns (session, private daemon or None, address, job id)."""
    daemon, err, address = None, None, server
    if server == "auto":
        if world > 1:
            hosts = _ddp.gather(socket.gethostname(), pg, world)
            if len(set(hosts)) > 1:
                raise ValueError(
                    "DMuon: server='auto' starts one dmuond on rank 0's host, but "
                    f"the ranks run on {sorted(set(hosts))}; start dmuond yourself "
                    "and pass server='host:port'")
        if rank == 0:
            try:
                daemon = LocalDaemon(flags=private_flags(daemon_flags, world),
                                     stop_grace=1.0)
                address = daemon.address
            except Exception as e:  # noqa: BLE001 - reported on every rank
                err, address = e, None
    if world > 1:
        address, job_id = _ddp.broadcast((address, job_id or _ddp.new_job_id()), pg)
    else:
        job_id = job_id or _ddp.new_job_id()
    if err is not None and world == 1:
        raise err
    session = None
    if address is not None:
        try:
            client = _ext.Client(address, deadline=float(timeout))
            session = client.open_session(job_id, table, groups, rank=rank,
                                          world_size=world, transport=transport)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            err = e
    elif err is None:
        err = RuntimeError("DMuon: rank 0 could not start dmuond")
    if world > 1:
        report = None if err is None else f"{type(err).__name__}: {err}"
        bad = [(r, m) for r, m in enumerate(_ddp.gather(report, pg, world)) if m]
        if bad and err is None:
            session.close()
            err = _ext.FailedPreconditionError(
                f"DMuon: rank {bad[0][0]} of job '{job_id}' could not open its "
                f"dmuond session: {bad[0][1]}")
    if err is not None:
        if daemon is not None:
            daemon.stop()
        raise err
    return session, daemon, address, job_id


def close(holder, daemon):
    """Closes the session `holder` holds, then stops the private daemon."""
    while holder:
        session = holder.pop()
        try:
            session.close()
        except Exception:  # noqa: BLE001 - the daemon may be gone already
            pass
        del session
    if daemon is not None:
        daemon.stop()

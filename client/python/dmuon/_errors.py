"""DMuon's errors when its dmuond is gone: a private one (server="auto")
that died becomes an UnavailableError that names the daemon, how it ended,
the tail of its log and what to do next; a lost connection to a shared one
says what happened to the step and how to continue the job."""

from __future__ import annotations

import contextlib
import signal

from . import _native


def explain(link, e):
    """e, explained for the session `link` (dmuon/_session.py Link): when its
    private LocalDaemon has died, an UnavailableError that names it, how it
    ended, its log's tail and what to do next; when the connection to a
    daemon this process did not start was lost, one that says so, names the
    job and how to continue it."""
    d = getattr(link, "daemon", None)  # link None: no session to name
    if getattr(e, "explained", False):
        return e
    if (getattr(e, "code", "") == "UNIMPLEMENTED"
            and "does not take absent parameters" in str(e)):
        return _older_daemon_absent(e)
    if d is None:
        return _shared_lost(link, e)
    # Its sockets close just before it is reaped: a lost connection waits
    # longer (a loaded machine can take over a second), other errors briefly.
    lost = isinstance(e, (_native.load().UnavailableError,
                          _native.load().DeadlineExceededError))
    try:
        d.process.wait(timeout=2.0 if lost else 0.5)
    except Exception:  # noqa: BLE001 - still running (or not our child)
        pass
    if d.alive():
        return e
    rc = d.process.returncode
    if rc < 0:
        try:
            how = f"was killed by signal {signal.Signals(-rc).name} ({-rc})"
        except ValueError:
            how = f"was killed by signal {-rc}"
    else:
        how = f"exited with status {rc}"
    hint = (" (SIGKILL from outside: often the kernel's OOM killer, see `dmesg`)"
            if rc == -signal.SIGKILL else "")
    tail = "\n".join("    " + line for line in d.log_tail(10).splitlines())
    err = _native.load().UnavailableError(
        f"DMuon: the private dmuond (pid {d.pid}, {d.binary}, at {d.address}, "
        f"started by DaemonOptions(server='auto')) {how}{hint}; the Muon momentum it "
        f"held is "
        f"gone with it. The last lines of its log ({d.log_path}):\n{tail}\n"
        "Next: create a new DMuon (it starts a new private dmuond) and "
        "load_state_dict() your last checkpoint, or run dmuond yourself and pass "
        f"daemon_options=DaemonOptions(server='host:port'). (The client's error: {e})")
    err.code, err.explained = "UNAVAILABLE", True
    return err


def _shared_lost(link, e):
    """e, or, when it says the connection to a shared dmuond was lost
    (UNAVAILABLE), an UnavailableError saying what happened to the step and
    how to go on."""
    if link is None or not isinstance(e, _native.load().UnavailableError):
        return e
    err = _native.load().UnavailableError(
        f"DMuon: the connection to dmuond at {link.address} (job "
        f"'{link.job_id}') was lost mid-training: the daemon stopped, restarted "
        "or became unreachable, and this step was not taken. Next: once dmuond "
        "is back, create a new DMuon with DaemonOptions(server=..., "
        f"job_id='{link.job_id}', resume=N), N your last checkpoint's step, and "
        "load_state_dict() that checkpoint (its AdamW state and step; with "
        "--state-dir dmuond keeps the Muon momentum of its last two snapshots, "
        "and resume=N refuses a step it does not hold); without --state-dir the "
        "momentum is gone: load your checkpoint into a fresh job. (The "
        f"client's error: {e})")
    err.code, err.explained = "UNAVAILABLE", True
    return err


def _older_daemon_absent(e):
    """A dmuond older than this client refused a parameter without a gradient
    over nccl (it asked for zeros, which would decay the momentum where
    torch.optim.Muon leaves it): say so, and what to do."""
    err = _native.load().Error(
        "DMuon: a Muon parameter had no gradient this step (.grad is None) and "
        "dmuond refused it over the nccl transport: that dmuond is older than "
        "this client and does not take absent parameters over nccl (this client "
        "no longer sends zeros for them, which decayed the momentum where "
        "torch.optim.Muon leaves it). Upgrade dmuond, or use another transport "
        f"(cuda_ipc on the daemon's host, shm, inline). (dmuond's error: {e})")
    err.code, err.explained = "UNIMPLEMENTED", True
    return err


class explained:  # lower case: used as a function, `with explained(link):`
    """dmuon errors raised inside, explained for the session `link`
    (explain(): a dead private daemon is named, with how it ended, its log
    and the next step; a lost shared one, with the job and how to go on).

    A plain class, not a generator under contextlib.contextmanager: it runs
    around every forward pre-hook's applies, between the trainer's kernels,
    where contextlib's frames cost several µs each (issue 25)."""

    __slots__ = ("_link",)

    def __init__(self, link):
        self._link = link

    def __enter__(self):
        return None

    def __exit__(self, typ, e, tb):
        if typ is None or not issubclass(typ, _native.load().Error):
            return False
        err = explain(self._link, e)
        if err is e:
            return False
        raise err from e


@contextlib.contextmanager
def fetching_momentum(link):
    """DMuon.state_dict(): a dmuon error inside (the Muon momentum held by
    the daemon of `link`, dmuon/_session.py, could not be fetched) raised
    again as its type (explained: explain()), naming the daemon and
    local_state_dict(), which saves the rest."""
    try:
        yield
    except _native.load().Error as e:
        err = explain(link, e)
        raise type(err)(
            f"DMuon.state_dict(): the Muon momentum is held by dmuond at "
            f"{link.address} and could not be fetched: {err}\nTo save what this "
            "process holds (AdamW's state and the parameter groups; Muon momentum "
            "restarts from zero when it is loaded), use opt.local_state_dict()."
        ) from e

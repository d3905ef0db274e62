"""A private dmuond for one process: what `server="auto"` starts.

The binary is looked for in $DMUON_DMUOND, inside this package (bin/dmuond,
as the wheel ships it), in the Bazel output of the source checkout
(bazel-bin/daemon/dmuond), then on $PATH. The daemon listens on 127.0.0.1
with a free port (so trainers on this host use shared memory), dies with its
parent (PR_SET_PDEATHSIG), and is stopped by `stop()`, when the object is
garbage-collected, or at interpreter exit, whichever comes first.

It runs in a session of its own (setsid), so a Ctrl-C in the terminal (SIGINT
to the foreground process group) reaches the trainer only: a trainer that
catches KeyboardInterrupt can still save a checkpoint, Muon momentum
included. Its work directory ($TMPDIR/dmuond-*: port file, log) records its
owner; one left behind by a trainer that was SIGKILLed (no finalizer ran) is
removed when the next private dmuond starts, once its trainer and its
daemon are both gone.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Sequence

from . import _native


def find_dmuond() -> str:
    """The dmuond binary server="auto" starts (the order: the module docstring)."""
    tried = []
    env = os.environ.get("DMUON_DMUOND")
    if env:
        if os.access(env, os.X_OK):
            return env
        raise FileNotFoundError(f"$DMUON_DMUOND={env} is not an executable file")
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "dmuond")
    tried.append(here)
    if os.access(here, os.X_OK):
        return here
    root = _native.checkout_root()
    if root:
        built = os.path.join(root, "bazel-bin", "daemon", "dmuond")
        tried.append(built)
        if os.access(built, os.X_OK):
            return built
    on_path = shutil.which("dmuond")
    if on_path:
        return on_path
    raise FileNotFoundError(
        "dmuon: DaemonOptions(server='auto') needs the dmuond binary and found none "
        "(looked at "
        + ", ".join(tried)
        + ", $PATH); set $DMUON_DMUOND, build it with `bazel build //daemon:dmuond`, "
        "or pass daemon_options=DaemonOptions(server='host:port') of a running dmuond"
    )


def _die_with_parent():
    # Runs in the child between fork and exec: SIGTERM when the parent dies.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _start_time(pid):
    """The process's start time in clock ticks since boot (/proc/PID/stat
    field 22), or None if there is no such process: with the pid, it names
    one process (pids are reused)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # exited, not yet reaped
        return None
    return int(fields[19])


def _running(pid, start):
    return start is not None and _start_time(pid) == start


OWNER = "owner.json"


def clean_stale_workdirs(root=None):
    """Removes this user's private dmuond work directories whose trainer and
    daemon have both exited (the trainer was SIGKILLed, so its finalizer
    never ran). Directories without an owner record are left alone. Returns
    the removed paths."""
    removed = []
    for path in glob.glob(os.path.join(root or tempfile.gettempdir(), "dmuond-*")):
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, OWNER)) as f:
                owner = json.load(f)
            if (_running(owner["trainer_pid"], owner["trainer_start"])
                    or _running(owner["daemon_pid"], owner["daemon_start"])):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being created, someone else's, or not ours to judge
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _stop(proc, workdir, grace):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    shutil.rmtree(workdir, ignore_errors=True)


class LocalDaemon:
    """Starts dmuond on 127.0.0.1 with a free port; `address` is where it is."""

    def __init__(self, binary: str | None = None, flags: Sequence[str] = (),
                 start_timeout: float = 30.0, stop_grace: float = 5.0) -> None:
        self.binary = binary or find_dmuond()
        clean_stale_workdirs()
        self.workdir = tempfile.mkdtemp(prefix="dmuond-")
        port_file = os.path.join(self.workdir, "port")
        self.log_path = os.path.join(self.workdir, "dmuond.log")
        argv = [
            self.binary,
            "--listen=127.0.0.1:0",
            f"--port-file={port_file}",
            "--summary-every-secs=0",
            "--log-level=warn",
            *flags,
        ]
        env = dict(os.environ)
        # The daemon shares this host's cores with the trainer: idle OpenBLAS
        # threads should sleep promptly rather than spin against backward.
        env.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
                close_fds=True,
                start_new_session=True,  # Ctrl-C's SIGINT is the trainer's alone
            )
        try:
            owner = dict(trainer_pid=os.getpid(), trainer_start=_start_time(os.getpid()),
                         daemon_pid=self.process.pid,
                         daemon_start=_start_time(self.process.pid))
            tmp = os.path.join(self.workdir, OWNER + ".tmp")
            with open(tmp, "w") as f:
                json.dump(owner, f)
            os.replace(tmp, os.path.join(self.workdir, OWNER))
        except OSError:
            pass  # only the clean-up of a SIGKILLed trainer's directory needs it
        self._finalizer = weakref.finalize(
            self, _stop, self.process, self.workdir, stop_grace
        )
        deadline = time.monotonic() + start_timeout
        port = ""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()  # before stop() removes the log
                self.stop()
                raise RuntimeError(
                    f"dmuon: the private dmuond ({self.binary}) exited with code "
                    f"{self.process.returncode} while starting: {tail}"
                )
            try:
                with open(port_file) as f:
                    port = f.read().strip()
            except FileNotFoundError:
                port = ""
            if port:
                break
            time.sleep(0.01)
        if not port:
            tail = self.log_tail()
            self.stop()
            raise TimeoutError(
                f"dmuon: the private dmuond ({self.binary}) did not start within "
                f"{start_timeout:.0f} s: {tail}"
            )
        self.address = f"127.0.0.1:{port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:]).strip() or "(no output)"
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stops the daemon (SIGTERM, then SIGKILL after the grace period)."""
        self._finalizer()

    def __enter__(self) -> LocalDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

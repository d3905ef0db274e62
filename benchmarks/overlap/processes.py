"""The processes of `./dmuon bench overlap`: dmuond pinned to the daemon's
cores, and trainer (trainer.py) and kernel-timing (ns_times.py) processes,
each pinned to its cores by itself.

dmuond gets one CPU executor and one OpenBLAS thread per core
(--cpu-executors, --cpu-threads, OPENBLAS_NUM_THREADS) and is pinned by
inheritance: this process sets its own affinity to the daemon's cores just
for the fork, so every thread dmuond starts is there from its first
instruction.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


@contextlib.contextmanager
def _pinned(cpus: list[int], env: dict[str, str]):
    """This process on `cpus` with `env` set, for a fork; restored after."""
    saved_cpus = os.sched_getaffinity(0)
    saved_env = {k: os.environ.get(k) for k in env}
    os.sched_setaffinity(0, cpus)
    os.environ.update(env)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved_cpus)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Trace:
    """One DMuon run's step timeline: dmuond's --trace-file always (the
    point reads its Newton-Schulz times from it: ns_times.from_trace), and
    with --trace each trainer's DMUON_TRACE too, in a scratch directory,
    merged into `directory`/`name`.json once the run is over (dmuon.trace
    merge). directory None: the daemon's file only, read by daemon_doc()
    and removed by close()."""

    def __init__(self, directory: str | None, name: str):
        self.out = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            self.out = os.path.join(directory, name + ".json")
        self.tmp = tempfile.TemporaryDirectory(prefix="overlap-trace-")
        self.daemon_file = os.path.join(self.tmp.name, "dmuond.json")

    def trainer_env(self, k: int) -> dict[str, str]:
        if self.out is None:
            return {}
        return {"DMUON_TRACE": os.path.join(self.tmp.name, f"trainer{k}.json")}

    def daemon_doc(self) -> dict:
        """dmuond's timeline (after it stopped: its last events flushed)."""
        from dmuon import trace

        return trace.load(self.daemon_file)

    def close(self, trainers: int) -> None:
        """Merges the files into `out` (with --trace); removes the scratch."""
        from dmuon import trace

        with self.tmp:
            if self.out is not None:
                files = [self.trainer_env(k)["DMUON_TRACE"] for k in range(trainers)]
                trace.merge_files(self.out, [*files, self.daemon_file])


def start_daemon(cpus: list[int], trace: Trace | None = None):
    """A private dmuond (dmuon's LocalDaemon: 127.0.0.1, a free port, dies
    with this process) on `cpus`, writing `trace`'s daemon file if given;
    stop() it when done."""
    from models import ROOT  # noqa: F401 (the dmuon package of this checkout)

    from dmuon._daemon import LocalDaemon

    n = str(len(cpus))
    flags = [f"--cpu-executors={n}", f"--cpu-threads={n}"]
    if trace:
        flags.append(f"--trace-file={trace.daemon_file}")
    with _pinned(cpus, {"OPENBLAS_NUM_THREADS": n}):
        daemon = LocalDaemon(flags=flags)
    allowed = thread_cpus(daemon.pid)
    if not allowed <= set(cpus):
        daemon.stop()
        raise RuntimeError(f"dmuond runs threads on cores {sorted(allowed)}, not only on "
                           f"--daemon-cpus {cpus}")
    return daemon


def thread_cpus(pid: int) -> set[int]:
    """Every core some thread of process `pid` may run on."""
    cpus: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        cpus |= os.sched_getaffinity(int(tid))
    return cpus


def start(script: str, args: list[str], env: dict[str, str] | None = None):
    """benchmarks/overlap/`script` with `args` and --out (and `env` added to
    this process's), started and not waited for (two trainers run at once);
    finish it with wait()."""
    tmp = tempfile.TemporaryDirectory(prefix="overlap-")
    out = os.path.join(tmp.name, "out.json")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, script), *args,
                             f"--out={out}"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env} if env else None)
    return proc, out, tmp


def wait(started, what: str) -> dict:
    """The JSON a process of start() wrote; its output's tail if it failed."""
    proc, out, tmp = started
    with tmp:
        log, _ = proc.communicate()
        if proc.returncode != 0:
            tail = "\n".join(log.strip().splitlines()[-15:])
            raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
        with open(out) as f:
            return json.load(f)


def trainer_args(model: str, tokens: int, cpus: str, warmup: int, steps: int,
                 optimizer: str = "adamw", mode: str = "run",
                 server: str | None = None) -> list[str]:
    args = [f"--model={model}", f"--tokens={tokens}", f"--cpus={cpus}",
            f"--warmup={warmup}", f"--steps={steps}", f"--optimizer={optimizer}",
            f"--mode={mode}"]
    return args + ([f"--server={server}"] if server else [])


def run_trainer(args: list[str], what: str) -> dict:
    return wait(start("trainer.py", args), what)


def ns_times(cpus: str, shapes: list[list[int]], repeats: int) -> dict:
    """Per-shape Newton-Schulz seconds on the daemon's cores (ns_times.py)."""
    args = [f"--cpus={cpus}", f"--shapes={json.dumps(shapes)}", f"--repeats={repeats}"]
    return wait(start("ns_times.py", args), "the Newton-Schulz timing")

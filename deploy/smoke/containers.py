"""dmuond containers under podman for the image smoke test.

`Dmuond` starts an image as the chart's DaemonSet runs it, as far as one
host allows: the host's network (`--network=host`; the daemon binds
127.0.0.1 on a free port, which it writes to a port file), the host's IPC
namespace and /dev/shm (`--ipc=host`, as `hostIPC: true`), a read-only root
file system, the image's own non-root user, and a state directory on a
host folder mounted at /var/lib/dmuond/state (the chart's `state.hostPath`).
`Registry` is a container registry on loopback (Debian's docker-registry,
the CNCF distribution registry), for `podman push` and `pull` as a user
does them against theirs. Every podman call goes through deploy/image/lib.sh's containers.conf, the
file `./dmuon setup` writes (CONTAINERS_CONF is set by the caller, smoke.sh,
or found in the project's cache here).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Sequence

UID = 65532  # the image's user (deploy/docker/Dockerfile)
STATE = "/var/lib/dmuond/state"
RUN = "/run/dmuond"


def containers_conf() -> str:
    """The project's containers.conf (deploy/image/lib.sh's path)."""
    if os.environ.get("CONTAINERS_CONF"):
        return os.environ["CONTAINERS_CONF"]
    cache = os.environ.get("DMUON_CONTAINERS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dmuon", "containers")
    return os.path.join(cache, "containers.conf")


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """podman ARGS with the project's containers.conf; output captured."""
    env = dict(os.environ, CONTAINERS_CONF=containers_conf())
    return subprocess.run(["podman", *args], env=env, capture_output=True, text=True,
                          check=check, timeout=timeout)


def run_labels() -> list[str]:
    """`--label dmuon.run=<id>` of this run (smoke.sh exports $DMUON_RUN_ID
    and removes every container with it on exit); none when unset."""
    run_id = os.environ.get("DMUON_RUN_ID")
    return ["--label", f"dmuon.run={run_id}"] if run_id else []


def owned_dir(path: Path) -> Path:
    """`path` made and handed to the image's user (it runs as uid 65532)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, UID, UID)
    return path


class Dmuond:
    """One dmuond container, started detached; `stop()` sends SIGTERM."""

    def __init__(self, image: str, state: Path | None, run_dir: Path,
                 devices: str = "cpu", flags: Sequence[str] = ()) -> None:
        self.name = f"dmuon-smoke-{uuid.uuid4().hex[:10]}"
        self.run_dir = owned_dir(run_dir)
        port_file = self.run_dir / "port"
        if port_file.exists():
            port_file.unlink()
        mounts = ["-v", f"{self.run_dir}:{RUN}"]
        args = ["--listen=127.0.0.1:0", f"--port-file={RUN}/port", f"--devices={devices}",
                "--cpu-threads=1", *flags]
        if state is not None:
            mounts += ["-v", f"{owned_dir(state)}:{STATE}"]
            args.append(f"--state-dir={STATE}")
        podman("run", "-d", "--name", self.name, *run_labels(), "--network=host", "--ipc=host",
               "--read-only", *mounts, image, *args)
        try:
            self.port = self._wait_port(port_file)
        except BaseException:  # no container left running behind a failed start
            self.remove()
            raise
        self.address = f"127.0.0.1:{self.port}"

    def _wait_port(self, port_file: Path, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = port_file.read_text().strip() if port_file.exists() else ""
            if text:
                return int(text)
            if self.state() != "running":
                raise RuntimeError(f"container {self.name} exited before serving:\n{self.logs()}")
            time.sleep(0.1)
        raise RuntimeError(f"container {self.name} wrote no port in {timeout} s:\n{self.logs()}")

    def state(self) -> str:
        return podman("inspect", "--format", "{{.State.Status}}", self.name, timeout=60).stdout.strip()

    def logs(self) -> str:
        r = podman("logs", self.name, check=False, timeout=60)
        return r.stdout + r.stderr

    def stop(self, grace: int = 30) -> int:
        """SIGTERM (podman stop), SIGKILL after `grace` s; the exit status."""
        podman("stop", "-t", str(grace), self.name, timeout=grace + 30)
        return int(podman("inspect", "--format", "{{.State.ExitCode}}", self.name).stdout)

    def remove(self) -> None:
        podman("rm", "-f", self.name, check=False, timeout=60)


REGISTRY_CONFIG = """version: 0.1
storage:
  filesystem:
    rootdirectory: {root}
http:
  addr: 127.0.0.1:{port}
"""


class Registry:
    """docker-registry serving on 127.0.0.1 (plain HTTP), its storage in
    `root`; `close()` stops it."""

    def __init__(self, root: Path, tries: int = 3) -> None:
        binary = shutil.which("docker-registry")
        if binary is None:
            raise RuntimeError("docker-registry is not installed: run ./dmuon setup")
        root.mkdir(parents=True, exist_ok=True)
        self.log = root / "registry.log"
        # The registry cannot report a port it chose: a free one is picked
        # and released, and another process may bind it first; the
        # registry then exits at once, and is tried again on another port.
        for attempt in range(1, tries + 1):
            self._start(binary, root)
            why = self._wait()
            if why is None:
                return
            self.close()
            if attempt == tries or "address already in use" not in why:
                raise RuntimeError(f"docker-registry did not serve on {self.address} "
                                   f"(try {attempt} of {tries}):\n{why}")

    def _start(self, binary: str, root: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = root / "config.yml"
        config.write_text(REGISTRY_CONFIG.format(root=root / "storage", port=self.port))
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen([binary, "serve", str(config)], stdout=log,
                                            stderr=subprocess.STDOUT)
        self.address = f"127.0.0.1:{self.port}"

    def _wait(self, timeout: float = 30) -> str | None:
        """None once it serves; its log when it exited or timed out."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"http://{self.address}/v2/", timeout=2).close()
                return None
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    return self.log.read_text()
                time.sleep(0.1)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

"""Tests of flags.py with fake dmuond/dmuonctl binaries (shell scripts that
print a --help in the real binaries' layout) and a hand-made Dockerfile.
Run by deploy/validate.sh with validate_test.py."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

import flags

DMUOND_HELP = """dmuond: the dmuon optimizer daemon.
  dmuond --listen=127.0.0.1:50051

flags:
  --devices (default: cpu)
      optimizer devices
  --listen (default: 127.0.0.1:50051)
      gRPC address to serve on
"""
DMUONCTL_HELP = """dmuonctl: operator CLI for dmuond.
  dmuonctl [--server=HOST:PORT] status [--json] | health | sessions | drain

flags:
  --server (default: 127.0.0.1:50051)
      dmuond address
"""


def fake_binary(folder: Path, name: str, help_text: str) -> Path:
    """An executable that prints help_text on stderr (as the real ones do)."""
    path = folder / name
    path.write_text(f"#!/bin/sh\ncat >&2 <<'EOF'\n{help_text}EOF\n", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def daemonset(args: list[str], probe: list[str]) -> dict[str, Any]:
    container = {"name": "dmuond", "image": "dmuond:1", "args": args,
                 "livenessProbe": {"exec": {"command": ["dmuonctl", *probe]}}}
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "dmuond"},
            "spec": {"template": {"spec": {"containers": [container]}}}}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A build context with what the test Dockerfiles copy and build."""
    (tmp_path / "daemon").mkdir()
    (tmp_path / "daemon" / "BUILD").write_text('cc_binary(name = "dmuond")\n', encoding="utf-8")
    (tmp_path / "dmuon").write_text("", encoding="utf-8")
    return tmp_path


def run(repo: Path, capsys: pytest.CaptureFixture[str], objs: list[Any], dockerfile: str | None = None,
        binaries: bool = True) -> tuple[int, list[str]]:
    rendered = repo / "rendered.yaml"
    rendered.write_text(yaml.safe_dump_all(objs), encoding="utf-8")
    argv = ["--root", str(repo)]
    if dockerfile is not None:
        (repo / "Dockerfile").write_text(dockerfile, encoding="utf-8")
        argv += ["--dockerfile", str(repo / "Dockerfile")]
    if binaries:
        argv += ["--dmuond", str(fake_binary(repo, "dmuond", DMUOND_HELP)),
                 "--dmuonctl", str(fake_binary(repo, "dmuonctl", DMUONCTL_HELP))]
    else:
        argv += ["--dmuond", str(repo / "missing" / "dmuond")]
    rc = flags.main([*argv, str(rendered)])
    return rc, capsys.readouterr().out.splitlines()


GOOD_DOCKERFILE = """FROM debian:12 AS build
COPY dmuon /src/dmuon
RUN bazel build //daemon:dmuond
HEALTHCHECK --interval=10s \\
  CMD ["dmuonctl", "--server=127.0.0.1:50051", "health"]
ENTRYPOINT ["dmuond"]
CMD ["--listen=0.0.0.0:50051"]
"""


def test_known_flags_pass(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run(repo, capsys, [daemonset(["--listen=0.0.0.0:50051", "--devices=auto"], ["--server=x:1", "health"])],
                  GOOD_DOCKERFILE)
    assert rc == 0, out
    assert out == [
        "ok Dockerfile: COPY sources and Bazel targets exist, ENTRYPOINT/CMD/HEALTHCHECK in exec form",
        "ok dmuond knows every flag rendered.yaml passes it (2)",
        "ok dmuond knows every flag Dockerfile ENTRYPOINT+CMD passes it (1)",
        "ok dmuonctl knows every flag rendered.yaml passes it (1)",
        "ok dmuonctl knows every flag Dockerfile HEALTHCHECK passes it (1)",
        "flags: 5 ok, 0 failed, 0 skipped",
    ]


def test_unknown_flag_and_command_fail(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run(repo, capsys, [daemonset(["--listen=0.0.0.0:50051", "--tls-cert=/x"], ["--server=x:1", "frobnicate"])])
    assert rc == 1
    assert "FAIL dmuond does not know what rendered.yaml passes it: unknown flag --tls-cert" in out
    assert "  dmuond --listen=0.0.0.0:50051 --tls-cert=/x" in out
    assert "FAIL dmuonctl does not know what rendered.yaml passes it: unknown command frobnicate" in out
    assert out[-1] == "flags: 0 ok, 2 failed, 0 skipped"


def test_missing_binary_is_skipped(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run(repo, capsys, [daemonset(["--bogus"], ["health"])], binaries=False)
    assert rc == 0
    assert out[0].startswith("skip dmuond: 1 command line(s) not checked (no binary at ")
    assert out[1] == "skip dmuonctl: 1 command line(s) not checked (no binary; build //daemon:dmuonctl)"


def test_dockerfile_problems(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dockerfile = """FROM debian:12
COPY missing.txt /src/
RUN bazel build //daemon:dmuonctl //tools:x
ENTRYPOINT dmuond --listen=0.0.0.0:1
"""
    rc, out = run(repo, capsys, [], dockerfile)
    assert rc == 1
    assert out[0] == "FAIL Dockerfile: 5 problem(s)"
    assert out[1:6] == [
        "  COPY source missing.txt does not exist in the build context (repository root)",
        "  ENTRYPOINT must use the exec (JSON array) form: dmuond --listen=0.0.0.0:1",
        "  ENTRYPOINT must be [\"dmuond\"], got null",
        "  Bazel target //daemon:dmuonctl is not defined in daemon/BUILD",
        "  Bazel package //tools has no BUILD file",
    ]


SETUP_DOCKERFILE = """FROM debian:12 AS build
WORKDIR /src
COPY dmuon /src/dmuon
RUN ./dmuon setup --no-venv && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["dmuond"]
"""


def test_setup_step_runs_with_only_what_is_copied(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`./dmuon` copied alone must run; one that sources a file the
    Dockerfile copies later must fail the check, naming the step."""
    good = (Path(__file__).resolve().parents[3] / "dmuon").read_text(encoding="utf-8")
    (repo / "dmuon").write_text(good, encoding="utf-8")
    rc, out = run(repo, capsys, [], SETUP_DOCKERFILE)
    assert rc == 0, out
    assert any("./dmuon runs (help, setup's arguments) with only dmuon copied" in line for line in out), out
    (repo / "lib.sh").write_text("true\n", encoding="utf-8")
    bad = good.replace("\nlog() {", '\nsource "$ROOT/lib.sh"\nlog() {', 1)
    assert bad != good
    (repo / "dmuon").write_text(bad, encoding="utf-8")
    rc, out = run(repo, capsys, [], SETUP_DOCKERFILE)
    assert rc == 1
    assert any(line.startswith("FAIL Dockerfile: the setup step's context") for line in out), out
    assert any("lib.sh: No such file or directory" in line for line in out), out

"""The READMEs' shell commands, run as written (issue: "the first hour").

Each block is read from the README itself at test time, so an edit to a
command is what runs:

- README.md, "Running the daemon": bazel build, dmuond in the background,
  `dmuonctl status`, the `curl` of /metrics, and `grpcurl` where it is
  installed (the README says setup does not install it: that sentence is
  checked instead when it is missing). Only the two ports and the state
  directory are replaced (free ports, a temporary directory; dmuonctl finds
  the daemon through $DMUON_SERVER, as the README says it does), so that
  the test runs beside anything else on the machine.
- client/python/README.md, "Install" (from a source checkout): setup, the
  bazel build and `PYTHONPATH=$PWD/client/python .venv/bin/python train.py`,
  where train.py is the README's first example with a tiny model, data and
  loss defined before it; it must train (the loss falls by 30% in 40 steps)
  with a private daemon.

The wheel block's file name is checked against the built wheel in
test_wheel.py."""

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

# Builds (cache hits), a daemon and a training run: more than pytest.ini's
# per-test limit on a busy machine; that limit is for hangs.
pytestmark = pytest.mark.timeout(600)


def block(readme, heading, lang=""):
    """The lines of the first ``` block (of `lang`) after `heading`."""
    text = (ROOT / readme).read_text()
    at = text.index(f"\n{heading}\n")
    m = re.compile(rf"^```{lang}\n(.*?)^```$", re.M | re.S).search(text, at)
    assert m, f"{readme}: no ```{lang} block after {heading!r}"
    return [line for line in m.group(1).splitlines() if line.strip()]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(line, env, timeout=300):
    """One README line in bash from the repository root; its output."""
    r = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{line}\nexit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_running_the_daemon(tmp_path):
    lines = block("README.md", "## Running the daemon")
    grpc_port, metrics_port = free_port(), free_port()
    state = tmp_path / "state"

    def local(line):
        return (line.replace("127.0.0.1:50051", f"127.0.0.1:{grpc_port}")
                .replace("127.0.0.1:9464", f"127.0.0.1:{metrics_port}")
                .replace("--metrics-port=9464", f"--metrics-port={metrics_port}")
                .replace("/tmp/dmuon-state", str(state)))

    env = dict(os.environ, DMUON_SERVER=f"127.0.0.1:{grpc_port}")
    build, daemon, *rest = [local(line) for line in lines]
    assert build.startswith("bazel build ") and "dmuond --listen=" in daemon, lines
    sh(build, env)
    log = open(tmp_path / "dmuond.log", "w")
    proc = subprocess.Popen(["bash", "-c", f"exec {daemon}"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        ctl = ROOT / "bazel-bin" / "daemon" / "dmuonctl"
        deadline = time.monotonic() + 60
        while subprocess.run([ctl, "health"], env=env, capture_output=True).returncode:
            assert proc.poll() is None, (tmp_path / "dmuond.log").read_text()
            assert time.monotonic() < deadline, "dmuond did not become healthy in 60 s"
            time.sleep(0.2)
        assert state.is_dir() and (state.stat().st_mode & 0o777) == 0o700
        ran = 0
        for line in rest:
            command = line.split("#")[0].strip()
            if command.startswith("grpcurl") and shutil.which("grpcurl") is None:
                assert "not installed by ./dmuon setup" in line, line
                continue
            out = sh(command, env, timeout=60)
            ran += 1
            if "dmuonctl status" in command:
                assert "EXECUTOR" in out.upper(), out
            if "/metrics" in command:
                assert re.search(r"^dmuon_\w+", out, re.M), out[:2000]
        assert ran >= 2, lines
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


# The README's first example needs a model with an lm_head, data and a loss.
PREAMBLE = '''
import torch
from torch import nn

torch.manual_seed(0)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.body = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 32)

    def forward(self, x):
        return self.lm_head(torch.relu(self.body(self.embed(x))))


model = Tiny()
x = torch.randint(0, 32, (64,))
data = [(x, (x + 1) % 32)] * 40
loss_fn = nn.functional.cross_entropy
with torch.no_grad():
    print("initial loss", float(loss_fn(model(x), (x + 1) % 32)))
'''

def test_install_from_a_source_checkout(tmp_path):
    lines = block("client/python/README.md", "## Install", "sh")
    setup, build, run = [line.split("  #")[0].strip() for line in lines]
    assert setup == "./dmuon setup" and build.startswith("bazel build "), lines
    assert run.endswith(" train.py"), run
    readme = (ROOT / "client" / "python" / "README.md").read_text()
    example = re.search(r"^```python\n(.*?)^```$", readme, re.M | re.S).group(1)
    train = tmp_path / "train.py"
    train.write_text(PREAMBLE + example + '\nprint("final loss", float(loss))\n'
                     "opt.close()\n")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    sh(setup, env)
    sh(build, env)
    out = sh(run.replace(" train.py", f" {train}"), env)
    initial, final = (float(re.search(rf"{w} loss ([\d.eE+-]+)", out).group(1))
                      for w in ("initial", "final"))
    assert final < 0.7 * initial, out  # it trained

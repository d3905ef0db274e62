"""The README's FSDP2 / TP / FSDP2 x TP / HSDP script
(examples/parallel_demo.py): the README's code block is that file, byte for
byte, and the file runs under torch's own launcher (`python -m
torch.distributed.run --nproc-per-node=4`, gloo on CPU) in each of its four
modes, with the daemon it picks itself (server="auto": a private dmuond that
rank 0 starts for the 4 ranks): exit code 0, rank 0's routing table shows
each matrix's sharding as SHARDING_BLOCKS handed off from a hook, and the
loss on its fixed batch goes down; a DeprecationWarning of dmuon's (a
deprecated spelling in the example) fails it. One launch per mode (about
10 s of it is 4 processes importing torch on 2 cores)."""

import os
import re
import subprocess
import sys

import pytest

from helpers import DMUON_DEPRECATIONS_FAIL
from ranks import free_port

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(PYTHON_DIR, "examples", "parallel_demo.py")
README = os.path.join(PYTHON_DIR, "README.md")
FIRST = b"# torchrun --nproc-per-node=4 examples/parallel_demo.py "


def readme_block():
    """The README's ```python block whose first line is FIRST."""
    with open(README, "rb") as f:
        text = f.read()
    start = text.index(b"```python\n" + FIRST) + len(b"```python\n")
    return text[start:text.index(b"\n```\n", start) + 1]


def test_readme_block_is_the_example_file():
    with open(DEMO, "rb") as f:
        assert readme_block() == f.read(), (
            "client/python/README.md's parallel_demo block and "
            "examples/parallel_demo.py differ: edit both alike")


# Rank 0's rows R x cols C of fc1 (0.weight, 256x64) and fc2 (2.weight,
# 64x256) on 4 ranks, and their placements as the routing table prints them.
EXPECTED = {
    "fsdp": {"0.weight": ("(Shard(dim=0))", "[0, 64)", "[0, 64)"),
             "2.weight": ("(Shard(dim=0))", "[0, 16)", "[0, 256)")},
    "tp": {"0.weight": ("(Shard(dim=0))", "[0, 64)", "[0, 64)"),
           "2.weight": ("(Shard(dim=1))", "[0, 64)", "[0, 64)")},
    "fsdp_tp": {"0.weight": ("(_StridedShard(dim=0, sf=2), Shard(dim=0))", "[0, 64)",
                             "[0, 64)"),
                "2.weight": ("(Shard(dim=0), Shard(dim=1))", "[0, 32)", "[0, 128)")},
    "hsdp": {"0.weight": ("(Replicate(), Shard(dim=0))", "[0, 128)", "[0, 64)"),
             "2.weight": ("(Replicate(), Shard(dim=0))", "[0, 32)", "[0, 256)")},
}
SHAPES = {"0.weight": "256x64", "2.weight": "64x256"}


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_parallel_demo_runs(mode):
    # faulthandler: a rank that aborts shows where its Python threads were.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env.pop("DMUON_SERVER", None)  # the demo's own daemon: server="auto"
    # No deprecated dmuon spelling in the example (helpers.py): a rank that
    # warns one fails.
    env["PYTHONWARNINGS"] = ",".join(
        w for w in (env.get("PYTHONWARNINGS"), DMUON_DEPRECATIONS_FAIL) if w)
    env["PYTHONPATH"] = os.pathsep.join(
        [PYTHON_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
           f"--master-port={free_port()}", DEMO, mode]
    p = subprocess.run(cmd, env=env, capture_output=True, timeout=150)
    out, err = p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
    assert p.returncode == 0, f"{mode}: exit {p.returncode}\n{out}\n{err}"
    # verbose=True: rank 0 (alone) prints the routing table to stdout
    rows = {line.split()[0]: line for line in out.splitlines() if line[:2] in ("0.", "2.", "4.")}
    for name, (placements, r, c) in EXPECTED[mode].items():
        want = (rf"{re.escape(name)}\s+{SHAPES[name]}\s+dmuond\s+{SHAPES[name]}\s+blocks"
                rf"\s+hook\s+.*DTensor {re.escape(placements)}, "
                rf"rows {re.escape(r)} x cols {re.escape(c)} here$")
        assert re.search(want, rows.get(name, "")), (mode, name, rows.get(name), out)
    assert rows["4.weight"].split()[2] == "adamw", out
    losses = [float(v) for v in re.findall(r"^step \d+: loss (\S+)$", out, re.M)]
    assert len(losses) == 2 and losses[1] < losses[0], (mode, out)

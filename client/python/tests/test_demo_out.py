"""The demo writes its results to an untracked folder (issue 29, item 11):
a run of `./dmuon demo` once rewrote the checked-in benchmarks/results."""

import json
import os
import subprocess
import sys

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(PYTHON_DIR))


def test_the_demo_leaves_the_checked_in_results_alone(tmp_path):
    results = os.path.join(ROOT, "benchmarks", "results", "demo.json")
    before = open(results, "rb").read()
    # Run from a copy's point of view: --out left to its default, which must
    # be an untracked folder of the checkout (out/demo, ignored by git).
    subprocess.run([sys.executable, os.path.join(PYTHON_DIR, "examples", "demo.py"),
                    "--steps", "2", "--device", "cpu"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=170)
    assert open(results, "rb").read() == before, "the demo rewrote benchmarks/results"
    out = os.path.join(ROOT, "out", "demo", "demo.json")
    assert json.load(open(out))["steps"] == 2
    ignored = subprocess.run(["git", "check-ignore", "-q", out], cwd=ROOT)
    assert ignored.returncode == 0, f"{out} is not ignored by git"

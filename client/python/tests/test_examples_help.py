"""Each example's --help (issue 29, item 11: `./dmuon demo --help` stopped
mid-sentence): the description is the docstring's whole first paragraph,
every option says what it is."""

import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples")
SCRIPTS = sorted(f for f in os.listdir(EXAMPLES)
                 if f.endswith(".py") and "argparse" in open(os.path.join(EXAMPLES, f)).read())


def test_the_examples_with_options_are_found():
    assert {"demo.py", "bench_client.py", "hf_trainer.py"} <= set(SCRIPTS), SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_whole(script):
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    usage, description, *_ = r.stdout.split("\n\n")
    assert description.rstrip().endswith("."), f"{script} --help stops mid-sentence:\n{r.stdout}"
    options = r.stdout.split("options:\n", 1)[1]
    entries = []  # [invocation, help text] per option; help may wrap below it
    for line in options.splitlines():
        m = re.match(r"  (-[^ ]+(?: [A-Z_]+)?(?:, -[^ ]+(?: [A-Z_]+)?)*)(?:\s\s+(.*))?$", line)
        if m:
            entries.append([m.group(1), m.group(2) or ""])
        elif entries and line.startswith("    "):
            entries[-1][1] += line.strip()
    assert entries, r.stdout
    for invocation, text in entries:
        assert text, f"{script}: {invocation} has no help text:\n{r.stdout}"

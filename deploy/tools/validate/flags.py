#!/usr/bin/env python3
"""Checks that the command lines the chart and the Dockerfile give dmuond and
dmuonctl parse, and that what the Dockerfile copies and builds exists
(deploy/validate.sh, step 5), and that `./dmuon setup` runs with only what
the Dockerfile copies before it (setup_context.py).

    .venv/bin/python deploy/tools/validate/flags.py --root REPO [--dockerfile FILE]
        [--dmuond BIN] [--dmuonctl BIN] RENDERED...

Command lines come from the rendered manifests (the dmuond container's
command and args, in workloads and in sidecar snippets; exec probes that run
dmuonctl) and from the Dockerfile (ENTRYPOINT + CMD, HEALTHCHECK). Every
--flag of each must be one the binary's `--help` lists (and each other word
of a dmuonctl line a command its help names). Values are not checked here
(the chart's schema and checks constrain them). Without a binary that check
is reported as skipped.

Prints one line per check, "ok MESSAGE", "FAIL MESSAGE" or "skip MESSAGE",
details indented by two spaces, then "flags: N ok, N failed, N skipped";
exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from manifests import as_dict, as_list, is_sidecar_snippet, load_documents, load_one  # noqa: E402
from setup_context import check_setup_context  # noqa: E402

PROGRAMS = ("dmuond", "dmuonctl")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
HELP_FLAG = re.compile(r"^\s*--([A-Za-z0-9][A-Za-z0-9_-]*)", re.M)
BAZEL_LABEL = re.compile(r"//([A-Za-z0-9_/.-]*):([A-Za-z0-9_.-]+)")


@dataclass
class CommandLine:
    argv: list[str]
    sources: list[str] = field(default_factory=list)


class Report:
    """The ok/FAIL/skip lines and their counts."""

    def __init__(self) -> None:
        self.counts = {"ok": 0, "FAIL": 0, "skip": 0}

    def say(self, kind: str, message: str, details: Sequence[str] = ()) -> None:
        self.counts[kind] += 1
        print(f"{kind} {message}")
        for d in details:
            print(f"  {d}")


class CommandLines:
    """The distinct command lines of each program, with where they come from."""

    def __init__(self) -> None:
        self.lines: dict[str, dict[str, CommandLine]] = {p: {} for p in PROGRAMS}

    def add(self, program: str, argv: list[Any], source: str) -> None:
        argv = [str(a) for a in argv]
        entry = self.lines[program].setdefault(json.dumps(argv), CommandLine(argv))
        if source not in entry.sources:
            entry.sources.append(source)


def pod_specs(obj: Any) -> list[dict[str, Any]]:
    """The pod specs of a rendered object: a workload's template, a Pod's
    spec, the sidecar snippet's pod-spec.yaml."""
    if not isinstance(obj, dict):
        return []
    out = []
    template = as_dict(as_dict(obj.get("spec")).get("template"))
    if isinstance(template.get("spec"), dict):
        out.append(template["spec"])
    if obj.get("kind") == "Pod":
        out.append(as_dict(obj.get("spec")))
    if is_sidecar_snippet(obj):
        text = as_dict(obj.get("data")).get("pod-spec.yaml")
        if text:
            out.append(as_dict(load_one(text)))
    return out


def collect_manifest_lines(files: list[str], lines: CommandLines) -> None:
    """Adds the dmuond and dmuonctl command lines of rendered manifests."""
    for file in files:
        label = Path(file).name
        for obj in load_documents(file):
            for spec in pod_specs(obj):
                for c in [*as_list(spec.get("initContainers")), *as_list(spec.get("containers"))]:
                    c = as_dict(c)
                    if c.get("name") == "dmuond":
                        if c.get("command"):
                            lines.add("dmuond", as_list(c["command"])[1:], label)
                        lines.add("dmuond", as_list(c.get("args")), label)
                    for probe in PROBES:
                        cmd = as_list(as_dict(as_dict(c.get(probe)).get("exec")).get("command"))
                        if cmd and cmd[0] == "dmuonctl":
                            lines.add("dmuonctl", cmd[1:], label)


# ------------------------------------------------------------------ Dockerfile

def dockerfile_instructions(text: str) -> list[str]:
    """Instructions with continuation lines joined and comments dropped."""
    out: list[str] = []
    cur = ""
    for raw in text.split("\n"):
        line = raw.rstrip()
        if not cur and line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip():
            out.append(cur.strip())
        cur = ""
    return out


def check_dockerfile(root: Path, dockerfile: Path, lines: CommandLines) -> list[str]:
    """Problems of the Dockerfile; adds its dmuond/dmuonctl command lines."""
    text = dockerfile.read_text(encoding="utf-8")
    problems: list[str] = []
    entrypoint: Any = None
    cmd: Any = None
    for ins in dockerfile_instructions(text):
        m = re.match(r"^(\w+)\s+(.*)$", ins, re.S)
        if not m:
            continue
        op, rest = m[1].upper(), m[2]
        if op in ("ENTRYPOINT", "CMD"):
            try:
                value = json.loads(rest)
            except json.JSONDecodeError:
                problems.append(f"{op} must use the exec (JSON array) form: {rest}")
                continue
            if op == "ENTRYPOINT":
                entrypoint = value
            else:
                cmd = value
        elif op == "HEALTHCHECK":
            hm = re.search(r"\bCMD\s+(\[.*\])\s*$", rest)
            argv = _json_list(hm[1]) if hm else None
            if argv is None:
                problems.append(f'HEALTHCHECK must use CMD ["dmuonctl", ...]: {rest}')
            else:
                if not argv or argv[0] != "dmuonctl":
                    problems.append(f"HEALTHCHECK runs {argv[0] if argv else 'nothing'}, expected dmuonctl")
                lines.add("dmuonctl", argv[1:], "Dockerfile HEALTHCHECK")
        elif op in ("COPY", "ADD"):
            parts = rest.split()
            if any(p.startswith("--from") for p in parts):
                continue
            for src in [p for p in parts if not p.startswith("--")][:-1]:
                if re.search(r"[*?$]", src):
                    continue
                if not (root / src).exists():
                    problems.append(f"{op} source {src} does not exist in the build context (repository root)")
    if not isinstance(entrypoint, list) or not entrypoint or entrypoint[0] != "dmuond":
        problems.append(f'ENTRYPOINT must be ["dmuond"], got {json.dumps(entrypoint)}')
    else:
        lines.add("dmuond", [*entrypoint[1:], *(cmd if isinstance(cmd, list) else [])],
                  "Dockerfile ENTRYPOINT+CMD")
    for pkg, name in BAZEL_LABEL.findall(text):
        build = next((root / pkg / b for b in ("BUILD", "BUILD.bazel") if (root / pkg / b).exists()), None)
        if build is None:
            problems.append(f"Bazel package //{pkg} has no BUILD file")
        elif not re.search(rf'name\s*=\s*"{re.escape(name)}"', build.read_text(encoding="utf-8")):
            problems.append(f"Bazel target //{pkg}:{name} is not defined in {build.relative_to(root)}")
    return problems


def _json_list(text: str) -> list[str] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [str(v) for v in value] if isinstance(value, list) else None


# ------------------------------------------------------------------ the binaries

@dataclass
class Help:
    text: str
    flags: set[str]


def help_of(binary: str) -> Help | str:
    """The flags a binary's --help lists, or why they could not be read."""
    try:
        r = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    text = f"{r.stdout}\n{r.stderr}"
    return Help(text, set(HELP_FLAG.findall(text)))


def check_program(program: str, binary: str | None, lines: CommandLines, report: Report) -> None:
    """One check per distinct command line of program."""
    entries = list(lines.lines[program].values())
    if not entries:
        return
    if not binary or not os.path.exists(binary):
        at = f" at {binary}" if binary else ""
        report.say("skip", f"{program}: {len(entries)} command line(s) not checked "
                           f"(no binary{at}; build //daemon:{program})")
        return
    help_ = help_of(binary)
    if isinstance(help_, str) or not help_.flags:
        report.say("FAIL", f"{program} --help lists no flags{': ' + help_ if isinstance(help_, str) else ''}")
        return
    for entry in entries:
        problems: list[str] = []
        for arg in entry.argv:
            if arg.startswith("--"):
                name = arg[2:].split("=", 1)[0]
                if name not in help_.flags:
                    problems.append(f"unknown flag --{name}")
            elif program == "dmuonctl" and not re.search(rf"\b{re.escape(arg)}\b", help_.text):
                problems.append(f"unknown command {arg}")
        where = ", ".join(entry.sources)
        if problems:
            report.say("FAIL", f"{program} does not know what {where} passes it: {', '.join(problems)}",
                       [f"{program} {' '.join(entry.argv)}"])
        else:
            n = sum(a.startswith("--") for a in entry.argv)
            report.say("ok", f"{program} knows every flag {where} passes it ({n})")


def check_setup_step(root: Path, dockerfile: Path, shown: str, report: Report) -> None:
    """The build stage's `RUN ./dmuon setup` in the context it has there."""
    try:
        problems, what = check_setup_context(root, dockerfile_instructions(dockerfile.read_text(encoding="utf-8")))
    except OSError as e:
        problems, what = [str(e)], ""
    if problems:
        report.say("FAIL", f"{shown}: the setup step's context", problems)
    elif what.startswith("./dmuon"):
        report.say("ok", f"{shown}: {what}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, required=True, help="repository root (the image's build context)")
    ap.add_argument("--dockerfile", type=Path)
    ap.add_argument("--dmuond")
    ap.add_argument("--dmuonctl")
    ap.add_argument("rendered", nargs="*")
    args = ap.parse_args(argv)
    report = Report()
    lines = CommandLines()
    try:
        collect_manifest_lines(args.rendered, lines)
    except (OSError, yaml.YAMLError) as e:
        report.say("FAIL", f"reading rendered manifests: {str(e).splitlines()[0]}")
    if args.dockerfile:
        shown = os.path.relpath(args.dockerfile, args.root)
        try:
            problems = check_dockerfile(args.root, args.dockerfile, lines)
        except OSError as e:
            problems = [str(e)]
        if problems:
            report.say("FAIL", f"{shown}: {len(problems)} problem(s)", problems)
        else:
            report.say("ok", f"{shown}: COPY sources and Bazel targets exist, "
                             "ENTRYPOINT/CMD/HEALTHCHECK in exec form")
        check_setup_step(args.root, args.dockerfile, shown, report)
    for program in PROGRAMS:
        check_program(program, getattr(args, program), lines, report)
    c = report.counts
    print(f"flags: {c['ok']} ok, {c['FAIL']} failed, {c['skip']} skipped")
    return 1 if c["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

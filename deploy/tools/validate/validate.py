#!/usr/bin/env python3
"""Offline validation of rendered Kubernetes manifests (deploy/validate.sh, step 3).

    .venv/bin/python deploy/tools/validate/validate.py [--compare-sidecar RENDERED EXAMPLE]... FILE...
    .venv/bin/python deploy/tools/validate/validate.py --print-kubernetes-version

(the project's Python environment, made by `./dmuon setup`, has the
packages it needs: kubernetes-validate, jsonschema, PyYAML).

Each FILE is a multi-document YAML. Every object is checked:
 1. against its schema, unknown fields failing (schema_check.py): built-in
    kinds with kubernetes-validate's strict schemas of Kubernetes
    KUBERNETES_VERSION, Prometheus-operator kinds with their CRD schema from
    deploy/schemas/; an apiVersion/kind with no schema is an error;
 2. by API-server rules the schemas do not encode (api_rules.py);
 3. with the other objects of its file, by cross-object rules
    (cross_rules.py).
ConfigMaps labelled dmuon.io/snippet=sidecar carry pod-spec.yaml and
job-patch.yaml: both are expanded into a Pod and a Job and checked the same
way. --compare-sidecar checks that the dmuond init container of the EXAMPLE
Job equals the one of the snippet in RENDERED (image aside).

Prints "ok   FILE: ..." or "FAIL FILE: N problem(s)" and one indented
"Kind/name: field: problem" line per problem, then the summary line
"validate: N object(s) in N file(s), N file(s) with problems".
Exit status 0 when everything passes, 1 otherwise, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from api_rules import check_metadata, check_pod  # noqa: E402
from cross_rules import cross_check  # noqa: E402
from manifests import (  # noqa: E402
    describe, dmuond_init, expand_snippet, is_sidecar_snippet, load_documents, pod_of, without,
)
from schema_check import KUBERNETES_VERSION, SchemaChecker  # noqa: E402


def check_object(checker: SchemaChecker, obj: Any) -> list[str]:
    """Every single-object problem of obj: schema, metadata, pod template."""
    if not isinstance(obj, dict):
        return [f"document is not a mapping (a {type(obj).__name__})"]
    return checker.errors(obj) + check_metadata(obj) + check_pod(obj)


def check_file(checker: SchemaChecker, file: str) -> tuple[int, list[str]]:
    """(objects checked, output lines) for one file; lines[0] is its
    "ok"/"FAIL" line."""
    try:
        docs = load_documents(file)
    except (OSError, yaml.YAMLError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return 0, [f"FAIL {file}: YAML: {first}"]
    problems: list[str] = []
    kinds: list[str] = []
    objects = 0

    def report(obj: Any, msg: str) -> None:
        problems.append(f"  {describe(obj)}: {msg}")

    for obj in docs:
        objects += 1
        kinds.append(str(obj.get("kind")) if isinstance(obj, dict) else "?")
        for e in check_object(checker, obj):
            report(obj, e)
        if not is_sidecar_snippet(obj):
            continue
        try:
            expanded = expand_snippet(obj)
        except (ValueError, yaml.YAMLError) as e:
            report(obj, f"sidecar snippet: {str(e).splitlines()[0]}")
            continue
        for x in expanded:
            objects += 1
            kinds.append(f"{x.obj['kind']}({x.key})")
            problems.extend(f"  {x.label} as {x.obj['kind']}: {e}" for e in check_object(checker, x.obj))
    cross_check(docs, report)
    if problems:
        return objects, [f"FAIL {file}: {len(problems)} problem(s)", *problems]
    return objects, [f"ok   {file}: {len(docs)} object(s): {', '.join(kinds)}"]


def diff_paths(want: Any, got: Any, at: str = "") -> list[str]:
    """Where got (the example) differs from want (the chart), leaf by leaf."""
    if want == got:
        return []
    if isinstance(want, dict) and isinstance(got, dict):
        keys = list(dict.fromkeys([*want, *got]))
        return [d for k in keys for d in diff_paths(want.get(k, _ABSENT), got.get(k, _ABSENT), f"{at}.{k}")]
    if isinstance(want, list) and isinstance(got, list):
        return [d for i in range(max(len(want), len(got)))
                for d in diff_paths(want[i] if i < len(want) else _ABSENT,
                                    got[i] if i < len(got) else _ABSENT, f"{at}[{i}]")]
    return [f"{at.lstrip('.')}: example {_show(got)} vs chart {_show(want)}"]


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def _show(value: Any) -> str:
    return repr(value) if value is _ABSENT else json.dumps(value)


def compare_sidecar(rendered: str, example: str) -> list[str]:
    """Output lines: the example Job's dmuond init container against the one
    of the chart's snippet in the rendered file (images aside)."""
    try:
        cm = next((o for o in load_documents(rendered) if is_sidecar_snippet(o)), None)
        job = next((o for o in load_documents(example) if pod_of(o) and dmuond_init(o)), None)
        snippet = next((x.obj for x in expand_snippet(cm) if x.obj["kind"] == "Job"), None) if cm else None
    except (OSError, ValueError, yaml.YAMLError) as e:
        return [f"FAIL sidecar example: {str(e).splitlines()[0]}"]
    if snippet is None or job is None:
        why = f"no sidecar snippet in {rendered}" if snippet is None else f"no dmuond init container in {example}"
        return [f"FAIL sidecar example: {why}"]
    want = without(dmuond_init(snippet) or {}, "image")
    got = without(dmuond_init(job) or {}, "image")
    diffs = diff_paths(want, got)
    if diffs:
        return [f"FAIL {example}: its dmuond sidecar differs from the chart's snippet ({rendered}):",
                *(f"  {d}" for d in diffs)]
    return [f"ok   {example}: dmuond sidecar matches the chart's snippet"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare-sidecar", nargs=2, action="append", default=[], metavar=("RENDERED", "EXAMPLE"))
    ap.add_argument("--print-kubernetes-version", action="store_true",
                    help="print the Kubernetes version the schemas are of, and exit")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args(argv)
    if args.print_kubernetes_version:
        print(KUBERNETES_VERSION)
        return 0
    try:
        checker = SchemaChecker()
    except (OSError, ValueError) as e:
        print(f"FAIL deploy/schemas: {e}")
        return 1
    objects = failures = 0
    for file in args.files:
        n, lines = check_file(checker, file)
        objects += n
        failures += lines[0].startswith("FAIL")
        print("\n".join(lines))
    for rendered, example in args.compare_sidecar:
        lines = compare_sidecar(rendered, example)
        failures += lines[0].startswith("FAIL")
        print("\n".join(lines))
    print(f"validate: {objects} object(s) in {len(args.files)} file(s), {failures} file(s) with problems "
          f"(Kubernetes {KUBERNETES_VERSION} schemas, strict)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

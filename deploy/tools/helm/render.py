#!/usr/bin/env python3
"""Renders and lints a chart with Helm's own engine (deploy/validate.sh).

    .venv/bin/python deploy/tools/helm/render.py CHART --kube-version V [-f VALUES]
        [--name R] [--namespace NS] [--skip-schema-validation] [--no-lint]
        [-o FILE] [--notes FILE]
    .venv/bin/python deploy/tools/helm/render.py --batch DIR < COMMAND_LINES

Helm v4 (helm.sh/helm/v4, the version helm_sdk_version() prints) comes from
the PyPI package helm-python-sdk, which binds Helm's Go SDK through a C ABI:
values coalescing, values.schema.json, the template functions (`required`,
`fail`, `tpl`, sprig) and the error messages are Helm's, not a copy of them.
What `helm template --kube-version V -f VALUES` and `helm lint --strict
--kube-version V -f VALUES` do, this does, in this order:

 1. the chart's `kubeVersion` constraint against V, refused with Helm's
    message ("chart requires kubeVersion: ... which is incompatible with
    Kubernetes V"). The SDK's render takes no Kubernetes version, so the
    comparison runs through Helm's own `semverCompare` (the Masterminds
    constraint check Helm's install action uses) in a one-template chart;
 2. render: values.schema.json checked unless --skip-schema-validation (the
    chart is then loaded without its schema, which is what Helm's flag
    does); a template's `fail`/`required`, a parse or execution error fails;
 3. lint in Helm's strict mode (`helm lint --strict`: a warning is an error)
    for V: Chart.yaml, values, every rendered document parsed as YAML, names,
    deprecated APIs for V, selectors. --no-lint leaves it out.

Helm v4 has no missing-key mode: neither `helm template` nor `helm lint
--strict` renders with missingkey=error any more (a reference to a missing
leaf renders empty; one below a missing map fails, nil pointer), so
nothing here claims to catch an unset leaf; the Kubernetes schemas of
tools/validate catch what that leaves in an object.

--batch runs one render per stdin line (its arguments, shell-quoted) in
this one process, so Helm's library loads once: line K's stderr goes to
DIR/K.err and its exit status to DIR/K.rc (K from 1).

Output: every object as `---`, `# Source: <template>`, the document, in
template-name order (not Helm's install order); NOTES.txt separately. Errors
go to stderr as "Error: <Helm's message>", exit status 1; 2 on usage errors.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
import tarfile
from pathlib import Path

import helm_python as helm

# A document separator line as Helm's releaseutil splits on it.
_DOC_SEP = re.compile(r"^---[ \t]*(#.*)?$", re.MULTILINE)

_PROBE_CHART = b"apiVersion: v2\nname: kubeversion-probe\nversion: 0.1.0\n"
_PROBE_TEMPLATE = b"{{ semverCompare .Values.constraint .Values.version }}"


class RenderError(Exception):
    """A chart that does not render, lint or fit V; the message is Helm's."""


def _archive(files: dict[str, bytes]) -> bytes:
    """A chart archive (.tgz) in memory: name/path -> contents."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def kube_version_fits(constraint: str, version: str) -> bool:
    """Helm's semverCompare(constraint, version); raises RenderError on a
    constraint or version Helm cannot parse."""
    archive = _archive({"probe/Chart.yaml": _PROBE_CHART, "probe/templates/check.txt": _PROBE_TEMPLATE})
    try:
        with helm.Chart.load_archive(archive) as probe:
            out = probe.render({"constraint": constraint, "version": version})
    except helm.HelmError as e:
        raise RenderError(f"kubeVersion {constraint!r} against Kubernetes {version}: {e}") from e
    return out["kubeversion-probe/templates/check.txt"].strip() == "true"


def _load(chart_dir: Path, skip_schema: bool) -> helm.Chart:
    """The chart; without values.schema.json when the schema is skipped."""
    if not skip_schema:
        return helm.Chart.load(chart_dir)
    files = {f"{chart_dir.name}/{p.relative_to(chart_dir).as_posix()}": p.read_bytes()
             for p in sorted(chart_dir.rglob("*"))
             if p.is_file() and p.name != "values.schema.json"}
    return helm.Chart.load_archive(_archive(files))


def render(chart_dir: Path, values: dict, *, kube_version: str, name: str = "dmuond",
           namespace: str = "default", skip_schema: bool = False, lint: bool = True) -> tuple[str, str]:
    """(manifests, NOTES.txt) of the chart for these user values; raises
    RenderError with Helm's message when Helm refuses them."""
    version = kube_version if kube_version.startswith("v") else "v" + kube_version
    try:
        with _load(chart_dir, skip_schema) as chart:
            constraint = chart.metadata.get("kubeVersion") or ""
            if constraint and not kube_version_fits(constraint, version):
                raise RenderError(f"chart requires kubeVersion: {constraint} which is incompatible "
                                  f"with Kubernetes {version}")
            rendered = chart.render(values, name=name, namespace=namespace)
        if lint:
            _lint(chart_dir, values, version, namespace, skip_schema)
    except helm.HelmError as e:
        raise RenderError(str(e).strip()) from e
    return _manifests(rendered), rendered.get(f"{chart_dir.name}/templates/NOTES.txt", "")


def _lint(chart_dir: Path, values: dict, version: str, namespace: str, skip_schema: bool) -> None:
    """`helm lint --strict`: any finding of warning severity or worse fails."""
    report = helm.lint(chart_dir, values, strict=True, kube_version=version, namespace=namespace,
                       skip_schema_validation=skip_schema)
    found = [f"[{'WARNING' if m['severity'] == 2 else 'ERROR'}] {m['path']}: {m['error']}"
             for m in report["messages"] if m["severity"] >= 2]
    if found or report["errors"]:
        raise RenderError("helm lint --strict:\n" + "\n".join(found or report["errors"]))


def _manifests(rendered: dict[str, str]) -> str:
    """Every non-empty YAML document, in template-name order, as helm
    template prints it."""
    out = []
    for template in sorted(rendered):
        if not template.endswith((".yaml", ".yml")):
            continue
        for doc in _DOC_SEP.split(rendered[template]):
            if doc is None or not any(line.strip() and not line.lstrip().startswith("#")
                                      for line in doc.splitlines()):
                continue
            out.append(f"---\n# Source: {template}\n{doc.strip(chr(10))}\n")
    return "".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("chart", type=Path)
    ap.add_argument("-f", "--values", type=Path, help="user values file (YAML)")
    ap.add_argument("--kube-version", required=True, help="Kubernetes version, e.g. v1.29.0")
    ap.add_argument("--name", default="dmuond", help="release name")
    ap.add_argument("--namespace", default="default", help="release namespace")
    ap.add_argument("--skip-schema-validation", action="store_true")
    ap.add_argument("--no-lint", action="store_true", help="render only")
    ap.add_argument("-o", "--output", type=Path, help="manifests here instead of stdout")
    ap.add_argument("--notes", type=Path, help="also write the rendered NOTES.txt here")
    args = ap.parse_args(argv)
    try:
        values = helm.values_from_yaml(args.values.read_text(encoding="utf-8")) if args.values else {}
        manifests, notes = render(args.chart, values, kube_version=args.kube_version, name=args.name,
                                  namespace=args.namespace, skip_schema=args.skip_schema_validation,
                                  lint=not args.no_lint)
    except (RenderError, helm.HelmError, OSError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    if args.notes:
        args.notes.write_text(notes, encoding="utf-8")
    if args.output:
        args.output.write_text(manifests, encoding="utf-8")
    else:
        sys.stdout.write(manifests)
    return 0


def batch(out_dir: Path, lines: list[str]) -> int:
    """main() for each command line; K.err and K.rc in out_dir."""
    for k, line in enumerate((line for line in lines if line.strip()), start=1):
        with open(out_dir / f"{k}.err", "w", encoding="utf-8") as err, contextlib.redirect_stderr(err):
            try:
                rc = main(shlex.split(line))
            except SystemExit as e:  # argparse's usage errors
                rc = e.code if isinstance(e.code, int) else 2
        (out_dir / f"{k}.rc").write_text(f"{rc}\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--batch"] and len(sys.argv) == 3:
        sys.exit(batch(Path(sys.argv[2]), sys.stdin.read().splitlines()))
    sys.exit(main(sys.argv[1:]))

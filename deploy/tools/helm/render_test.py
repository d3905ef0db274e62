"""Tests of render.py on small charts made per test: what it renders must be
what the values say, and each thing it exists to refuse (a bad template, a
values.schema.json violation, a lint warning under --strict, a Kubernetes
version outside the chart's kubeVersion) must fail with Helm's message
naming the culprit. Run by deploy/validate.sh:

    .venv/bin/python -m pytest deploy/tools/helm
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import render

RENDER = Path(__file__).resolve().parent / "render.py"

SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "additionalProperties": False,
    "properties": {"port": {"type": "integer", "minimum": 1, "maximum": 65535},
                   "name": {"type": "string"}},
}

CONFIGMAP = """apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-{{ .Values.name }}
  namespace: {{ .Release.Namespace }}
data:
  port: {{ .Values.port | quote }}
"""


def make_chart(root: Path, templates: dict[str, str], *, kube_version: str = "",
               schema: dict | None = None) -> Path:
    """A chart named probe under root with values port/name."""
    chart = root / "probe"
    (chart / "templates").mkdir(parents=True)
    meta = {"apiVersion": "v2", "name": "probe", "version": "0.1.0", "icon": "https://example.com/i.png"}
    if kube_version:
        meta["kubeVersion"] = kube_version
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    (chart / "values.yaml").write_text("port: 8080\nname: web\n")
    if schema is not None:
        (chart / "values.schema.json").write_text(json.dumps(schema))
    for name, text in templates.items():
        (chart / "templates" / name).write_text(text)
    return chart


def test_renders_the_values_given(tmp_path: Path) -> None:
    rng = random.Random()
    chart = make_chart(tmp_path, {"cm.yaml": CONFIGMAP, "NOTES.txt": "port {{ .Values.port }}\n"},
                       schema=SCHEMA)
    for _ in range(3):
        port, name = rng.randint(1, 65535), f"n{rng.randrange(10**6)}"
        release, ns = f"r{rng.randrange(1000)}", f"ns{rng.randrange(1000)}"
        out, notes = render.render(chart, {"port": port, "name": name}, kube_version="v1.30.0",
                                   name=release, namespace=ns)
        assert out.startswith("---\n# Source: probe/templates/cm.yaml\n")
        (cm,) = list(yaml.safe_load_all(out))
        assert cm["metadata"] == {"name": f"{release}-{name}", "namespace": ns}
        assert cm["data"] == {"port": str(port)}
        assert notes == f"port {port}\n"


def test_defaults_and_several_documents(tmp_path: Path) -> None:
    two = CONFIGMAP + "---\n# only a comment\n---\n" + CONFIGMAP.replace("-{{ .Values.name }}", "-second")
    chart = make_chart(tmp_path, {"cm.yaml": two})
    out, _ = render.render(chart, {}, kube_version="v1.30.0")
    names = [o["metadata"]["name"] for o in yaml.safe_load_all(out)]
    assert names == ["dmuond-web", "dmuond-second"]
    assert out.count("# Source: probe/templates/cm.yaml") == 2


def test_refuses_a_template_that_does_not_parse(tmp_path: Path) -> None:
    chart = make_chart(tmp_path, {"cm.yaml": CONFIGMAP, "broken.yaml": "a: {{ .Values.port \n"})
    with pytest.raises(render.RenderError, match=r"parse error.*broken\.yaml"):
        render.render(chart, {}, kube_version="v1.30.0")


def test_refuses_a_reference_below_a_missing_value(tmp_path: Path) -> None:
    bad = CONFIGMAP + "  extra: {{ .Values.tls.secretName }}\n"
    chart = make_chart(tmp_path, {"cm.yaml": bad})
    with pytest.raises(render.RenderError, match=r"(?s)cm\.yaml:8:19.*nil pointer evaluating interface {}\.secretName"):
        render.render(chart, {}, kube_version="v1.30.0")


def test_refuses_values_against_the_schema_naming_the_field(tmp_path: Path) -> None:
    chart = make_chart(tmp_path, {"cm.yaml": CONFIGMAP}, schema=SCHEMA)
    with pytest.raises(render.RenderError, match=r"at '/port': got string, want integer"):
        render.render(chart, {"port": "http"}, kube_version="v1.30.0")
    with pytest.raises(render.RenderError, match=r"at '/port': maximum: got 70,000, want 65,535"):
        render.render(chart, {"port": 70000}, kube_version="v1.30.0")
    with pytest.raises(render.RenderError, match=r"additional properties 'prot' not allowed"):
        render.render(chart, {"prot": 1}, kube_version="v1.30.0")
    # Skipped, the template sees the value as given (and lint skips it too).
    out, _ = render.render(chart, {"port": "http"}, kube_version="v1.30.0", skip_schema=True)
    assert next(yaml.safe_load_all(out))["data"]["port"] == "http"


def test_refuses_what_the_template_fails(tmp_path: Path) -> None:
    guard = '{{- if lt (int .Values.port) 1024 }}{{ fail (printf "port %d is privileged" (int .Values.port)) }}{{ end }}\n'
    chart = make_chart(tmp_path, {"cm.yaml": guard + CONFIGMAP})
    with pytest.raises(render.RenderError, match=r"port 80 is privileged"):
        render.render(chart, {"port": 80}, kube_version="v1.30.0")
    render.render(chart, {"port": 8443}, kube_version="v1.30.0")


def test_lint_is_strict(tmp_path: Path) -> None:
    # A document that starts indented renders, but helm lint warns; strict
    # lint (what validate.sh runs) makes the warning an error.
    chart = make_chart(tmp_path, {"cm.yaml": "  " + CONFIGMAP.replace("\n", "\n  ")})
    render.render(chart, {}, kube_version="v1.30.0", lint=False)
    with pytest.raises(render.RenderError, match=r"helm lint --strict:\n\[WARNING\] templates/cm\.yaml: "
                                                 r"document starts with an illegal indent"):
        render.render(chart, {}, kube_version="v1.30.0")


def _fits(version: tuple[int, int, int], floor: tuple[int, int, int]) -> bool:
    return version >= floor


def test_kube_version_against_the_charts_floor(tmp_path: Path) -> None:
    chart = make_chart(tmp_path, {"cm.yaml": CONFIGMAP}, kube_version=">=1.29.0-0")
    with pytest.raises(render.RenderError, match=r"^chart requires kubeVersion: >=1\.29\.0-0 which is "
                                                 r"incompatible with Kubernetes v1\.28\.9$"):
        render.render(chart, {}, kube_version="v1.28.9")
    rng = random.Random()
    for _ in range(6):
        v = (1, rng.randint(20, 40), rng.randint(0, 15))
        text = "v%d.%d.%d" % v
        assert render.kube_version_fits(">=1.29.0-0", text) == _fits(v, (1, 29, 0)), text
    render.render(chart, {}, kube_version="1.29.0")  # without the v, as helm accepts it
    with pytest.raises(render.RenderError, match=r"kubeVersion '>=one' against Kubernetes v1\.30\.0"):
        render.kube_version_fits(">=one", "v1.30.0")


def test_command_line(tmp_path: Path) -> None:
    chart = make_chart(tmp_path, {"cm.yaml": CONFIGMAP, "NOTES.txt": "hello {{ .Values.name }}\n"},
                       schema=SCHEMA)
    values = tmp_path / "v.yaml"
    values.write_text("name: from-file\n")
    out, notes = tmp_path / "out.yaml", tmp_path / "notes.txt"
    ok = subprocess.run([sys.executable, str(RENDER), str(chart), "-f", str(values), "--kube-version",
                         "v1.29.0", "-o", str(out), "--notes", str(notes)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert next(yaml.safe_load_all(out.read_text()))["metadata"]["name"] == "dmuond-from-file"
    assert notes.read_text() == "hello from-file\n"
    values.write_text("port: [1]\n")
    bad = subprocess.run([sys.executable, str(RENDER), str(chart), "-f", str(values), "--kube-version",
                          "v1.29.0"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.startswith("Error: ") and "at '/port': got array, want integer" in bad.stderr


def test_batch_runs_each_line_alone(tmp_path: Path) -> None:
    chart = make_chart(tmp_path, {"cm.yaml": CONFIGMAP}, schema=SCHEMA)
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("port: 9000\n")
    bad.write_text("port: 0\n")
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    lines = [f"{chart} --kube-version v1.29.0 -f {bad} -o /dev/null",
             f"{chart} --kube-version v1.29.0 -f {good} -o {tmp_path / 'out.yaml'}",
             f"{chart} --kube-version v1.29.0 --no-such-flag", ""]
    done = subprocess.run([sys.executable, str(RENDER), "--batch", str(jobs)], input="\n".join(lines),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [(jobs / f"{k}.rc").read_text() for k in (1, 2, 3)] == ["1\n", "0\n", "2\n"]
    assert not (jobs / "4.rc").exists()
    assert "at '/port': minimum: got 0, want 1" in (jobs / "1.err").read_text()
    assert (jobs / "2.err").read_text() == ""
    assert "unrecognized arguments: --no-such-flag" in (jobs / "3.err").read_text()
    assert next(yaml.safe_load_all((tmp_path / "out.yaml").read_text()))["data"]["port"] == "9000"

"""Negative and positive tests of validate.py: each check must reject what it
is there to reject, with a message naming the object and the field, and
accept a valid release. Run by deploy/validate.sh:

    .venv/bin/python -m pytest deploy/tools/validate
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import validate
from schema_check import KUBERNETES_VERSION, SchemaChecker, kubernetes_errors, load_crd_schemas

LABELS = {"app.kubernetes.io/name": "web"}

DEPLOYMENT: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "web", "namespace": "demo", "labels": dict(LABELS)},
    "spec": {
        "selector": {"matchLabels": dict(LABELS)},
        "template": {
            "metadata": {"labels": dict(LABELS)},
            "spec": {
                "containers": [{
                    "name": "web",
                    "image": "registry.example.com/web:1",
                    "ports": [{"name": "http", "containerPort": 8080},
                              {"name": "metrics", "containerPort": 9464}],
                    "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}},
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }],
                "volumes": [{"name": "data", "emptyDir": {}}],
            },
        },
    },
}
SERVICE: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "web", "namespace": "demo", "labels": dict(LABELS)},
    "spec": {"selector": dict(LABELS),
             "ports": [{"name": "metrics", "port": 9464, "targetPort": "metrics"}]},
}
SERVICE_MONITOR: dict[str, Any] = {
    "apiVersion": "monitoring.coreos.com/v1",
    "kind": "ServiceMonitor",
    "metadata": {"name": "web", "namespace": "demo", "labels": {"release": "prometheus"}},
    "spec": {"selector": {"matchLabels": dict(LABELS)},
             "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]},
}
POD_MONITOR: dict[str, Any] = {
    "apiVersion": "monitoring.coreos.com/v1",
    "kind": "PodMonitor",
    "metadata": {"name": "web", "namespace": "demo"},
    "spec": {"selector": {"matchLabels": dict(LABELS)},
             "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics"}]},
}


def release() -> list[dict[str, Any]]:
    """A valid release: Deployment, Service, ServiceMonitor and PodMonitor."""
    return copy.deepcopy([DEPLOYMENT, SERVICE, SERVICE_MONITOR, POD_MONITOR])


@pytest.fixture(scope="module")
def checker() -> SchemaChecker:
    return SchemaChecker()


def run(checker: SchemaChecker, tmp_path: Path, objs: list[Any], name: str = "release.yaml") -> list[str]:
    """check_file() over objs written as one multi-document file."""
    f = tmp_path / name
    f.write_text(yaml.safe_dump_all(objs, sort_keys=False), encoding="utf-8")
    return validate.check_file(checker, str(f))[1]


def assert_rejected(lines: list[str], *expected: str) -> None:
    assert lines[0].startswith("FAIL "), lines
    text = "\n".join(lines)
    for e in expected:
        assert e in text, f"{e!r} not in:\n{text}"


# ------------------------------------------------------------------ accepted

def test_valid_release_passes(checker: SchemaChecker, tmp_path: Path) -> None:
    lines = run(checker, tmp_path, release())
    assert lines == [f"ok   {tmp_path / 'release.yaml'}: 4 object(s): "
                     "Deployment, Service, ServiceMonitor, PodMonitor"]


def test_the_crd_schemas_are_there() -> None:
    assert {("monitoring.coreos.com/v1", "ServiceMonitor"),
            ("monitoring.coreos.com/v1", "PodMonitor")} <= set(load_crd_schemas())


# ------------------------------------------------------------------ Kubernetes schemas

def test_unknown_field_in_a_deployment(checker: SchemaChecker, tmp_path: Path) -> None:
    objs = release()
    objs[0]["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    objs[0]["spec"]["replica"] = 2
    assert_rejected(run(checker, tmp_path, objs),
                    "Deployment/web: spec.template.spec.containers[0].imagePullPolicyy: unknown field",
                    "Deployment/web: spec.replica: unknown field")


def test_wrong_type_in_a_deployment(checker: SchemaChecker, tmp_path: Path) -> None:
    objs = release()
    objs[0]["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8080"
    assert_rejected(run(checker, tmp_path, objs),
                    "Deployment/web: spec.template.spec.containers[0].ports[0].containerPort: "
                    'must be integer, got string "8080"')


def test_missing_required_field(checker: SchemaChecker, tmp_path: Path) -> None:
    objs = release()
    del objs[0]["spec"]["selector"]
    assert_rejected(run(checker, tmp_path, objs), "Deployment/web: spec: 'selector' is a required property")


def test_every_error_is_reported_and_the_verdict_is_the_librarys() -> None:
    dep = copy.deepcopy(DEPLOYMENT)
    dep["metadata"]["bogus"] = 1
    dep["spec"]["paused"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBERNETES_VERSION, strict=True)
    assert kubernetes_errors(dep) == ["metadata.bogus: unknown field",
                                      'spec.paused: must be boolean or null, got string "yes"']
    assert kubernetes_errors(copy.deepcopy(DEPLOYMENT)) == []


def test_the_kubernetes_version_is_enforced() -> None:
    # securityContext.appArmorProfile appeared in Kubernetes 1.30: the chart
    # supports 1.29, so it must be refused.
    dep = copy.deepcopy(DEPLOYMENT)
    dep["spec"]["template"]["spec"]["containers"][0]["securityContext"] = {"appArmorProfile": {"type": "RuntimeDefault"}}
    assert kubernetes_errors(dep, "1.30") == []
    assert kubernetes_errors(dep, KUBERNETES_VERSION) == [
        "spec.template.spec.containers[0].securityContext.appArmorProfile: unknown field"]


def test_kind_without_a_schema(checker: SchemaChecker, tmp_path: Path) -> None:
    odd = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    probe = {"apiVersion": "monitoring.coreos.com/v1", "kind": "Probe", "metadata": {"name": "p"}}
    assert_rejected(run(checker, tmp_path, [odd, probe]),
                    "Widget/w: no schema for apiVersion example.com/v1 kind Widget",
                    "Probe/p: no schema for apiVersion monitoring.coreos.com/v1 kind Probe")


# ------------------------------------------------------------------ CRD schemas

def test_unknown_field_in_a_servicemonitor_endpoint(checker: SchemaChecker, tmp_path: Path) -> None:
    objs = release()
    objs[2]["spec"]["endpoints"][0]["scrapeInterval"] = "15s"
    assert_rejected(run(checker, tmp_path, objs),
                    "ServiceMonitor/web: spec.endpoints[0].scrapeInterval: unknown field")


def test_unknown_field_in_a_servicemonitor_spec_and_metadata(checker: SchemaChecker, tmp_path: Path) -> None:
    objs = release()
    objs[2]["spec"]["namespaceSelectors"] = {"any": True}
    objs[2]["metadata"]["label"] = {"a": "b"}
    assert_rejected(run(checker, tmp_path, objs),
                    "ServiceMonitor/web: spec.namespaceSelectors: unknown field",
                    "ServiceMonitor/web: metadata.label: unknown field")


def test_wrong_types_in_monitors(checker: SchemaChecker, tmp_path: Path) -> None:
    objs = release()
    objs[2]["spec"]["endpoints"][0]["honorLabels"] = "true"
    objs[3]["spec"]["podMetricsEndpoints"] = {"port": "metrics"}
    assert_rejected(run(checker, tmp_path, objs),
                    'ServiceMonitor/web: spec.endpoints[0].honorLabels: must be boolean, got string "true"',
                    "PodMonitor/web: spec.podMetricsEndpoints: must be array, got object")


def test_servicemonitor_enum_and_pattern(checker: SchemaChecker, tmp_path: Path) -> None:
    objs = release()
    objs[2]["spec"]["endpoints"][0]["scheme"] = "gopher"
    objs[2]["spec"]["endpoints"][0]["interval"] = "15 seconds"
    assert_rejected(run(checker, tmp_path, objs),
                    "ServiceMonitor/web: spec.endpoints[0].scheme: ",
                    "ServiceMonitor/web: spec.endpoints[0].interval: '15 seconds' does not match")


# ------------------------------------------------------------------ API and cross-object rules

def test_servicemonitor_port_must_name_a_service_port(checker: SchemaChecker, tmp_path: Path) -> None:
    objs = release()
    objs[2]["spec"]["endpoints"][0]["port"] = "metricz"
    assert_rejected(run(checker, tmp_path, objs),
                    "ServiceMonitor/web: spec.endpoints: port metricz is not a port name of the selected Service")


def test_selectors_must_match(checker: SchemaChecker, tmp_path: Path) -> None:
    objs = release()
    objs[1]["spec"]["selector"] = {"app.kubernetes.io/name": "other"}
    objs[2]["spec"]["selector"]["matchLabels"] = {"app.kubernetes.io/name": "other"}
    objs[3]["spec"]["podMetricsEndpoints"][0]["port"] = "metricz"
    assert_rejected(run(checker, tmp_path, objs),
                    "Service/web: spec.selector matches no pod template in this render",
                    "ServiceMonitor/web: spec.selector matches no Service in this render",
                    "PodMonitor/web: spec.podMetricsEndpoints: port metricz names no container port")


def test_pod_rules(checker: SchemaChecker, tmp_path: Path) -> None:
    objs = release()
    pod = objs[0]["spec"]["template"]["spec"]
    pod["containers"][0]["volumeMounts"][0]["name"] = "date"
    pod["containers"][0]["readinessProbe"]["httpGet"]["port"] = "htp"
    pod["initContainers"] = [{"name": "init", "image": "busybox", "livenessProbe": {"grpc": {"port": 1}}}]
    pod["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "0.5"}}
    assert_rejected(run(checker, tmp_path, objs),
                    "spec.template.spec.containers[0](web).volumeMounts: date names no volume of the pod",
                    "spec.template.spec.containers[0](web).readinessProbe.httpGet.port: no container port named htp",
                    "spec.template.spec.initContainers[0](init).livenessProbe: probes are only allowed on "
                    "restartable init containers",
                    "spec.template.spec.containers[0](web).resources.limits.nvidia.com/gpu: an extended resource "
                    "must be a whole number")


def test_duplicates_and_names(checker: SchemaChecker, tmp_path: Path) -> None:
    objs = release()
    objs.append(copy.deepcopy(objs[1]))
    objs[0]["metadata"]["labels"]["app.kubernetes.io/name"] = "Not A Label"
    objs[0]["spec"]["template"]["metadata"]["labels"]["x"] = "a" * 64
    assert_rejected(run(checker, tmp_path, objs),
                    "Service/web: duplicate object Service/demo/web",
                    'Deployment/web: metadata.labels: label app.kubernetes.io/name="Not A Label" is not a valid label value',
                    "Deployment/web: spec.template.metadata.labels: label x=")


def test_pdb_bounds(checker: SchemaChecker, tmp_path: Path) -> None:
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "web"},
           "spec": {"selector": {"matchLabels": dict(LABELS)}, "minAvailable": 1, "maxUnavailable": 1}}
    assert_rejected(run(checker, tmp_path, [*release(), pdb]),
                    "PodDisruptionBudget/web: spec: minAvailable and maxUnavailable are mutually exclusive")


# ------------------------------------------------------------------ sidecar snippet

SIDECAR = {"name": "dmuond", "image": "dmuond:1", "restartPolicy": "Always", "args": ["--listen=0.0.0.0:50051"]}


def snippet_configmap(pod_spec: dict[str, Any]) -> dict[str, Any]:
    job_patch = {"spec": {"template": {"spec": copy.deepcopy(pod_spec)}}}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "dmuond-sidecar", "labels": {"dmuon.io/snippet": "sidecar"}},
            "data": {"pod-spec.yaml": yaml.safe_dump(pod_spec), "job-patch.yaml": yaml.safe_dump(job_patch)}}


def test_snippet_is_expanded_and_checked(checker: SchemaChecker, tmp_path: Path) -> None:
    good = snippet_configmap({"initContainers": [SIDECAR], "containers": [{"name": "trainer"}]})
    assert run(checker, tmp_path, [good])[0].endswith("ConfigMap, Pod(pod-spec.yaml), Job(job-patch.yaml)")
    bad = snippet_configmap({"initContainers": [{**SIDECAR, "restartPolicy": "Never", "argz": []}],
                             "containers": [{"name": "trainer"}]})
    assert_rejected(run(checker, tmp_path, [bad]),
                    "dmuond-sidecar:pod-spec.yaml as Pod: spec.initContainers[0].argz: unknown field",
                    "dmuond-sidecar:job-patch.yaml as Job: spec.template.spec.initContainers[0](dmuond).restartPolicy: "
                    "only init containers may set it, and only to Always")


def test_compare_sidecar(tmp_path: Path) -> None:
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump(snippet_configmap({"initContainers": [SIDECAR]})), encoding="utf-8")
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train"},
           "spec": {"template": {"spec": {"restartPolicy": "Never", "initContainers": [{**SIDECAR, "image": "other:2"}],
                                          "containers": [{"name": "trainer", "image": "t:1"}]}}}}
    example = tmp_path / "job.yaml"
    example.write_text(yaml.safe_dump(job), encoding="utf-8")
    assert validate.compare_sidecar(str(rendered), str(example))[0].startswith("ok ")
    job["spec"]["template"]["spec"]["initContainers"][0]["args"] = ["--listen=0.0.0.0:50052"]
    example.write_text(yaml.safe_dump(job), encoding="utf-8")
    lines = validate.compare_sidecar(str(rendered), str(example))
    assert lines[0].startswith(f"FAIL {example}: its dmuond sidecar differs"), lines
    assert '  args[0]: example "--listen=0.0.0.0:50052" vs chart "--listen=0.0.0.0:50051"' in lines


# ------------------------------------------------------------------ command line

def test_main_summary_and_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump_all(release()), encoding="utf-8")
    bad.write_text("kind: [unclosed\n", encoding="utf-8")
    assert validate.main([str(good)]) == 0
    assert validate.main([str(good), str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith(f"FAIL {bad}: YAML: ")
    assert out[-1] == (f"validate: 4 object(s) in 2 file(s), 1 file(s) with problems "
                       f"(Kubernetes {KUBERNETES_VERSION} schemas, strict)")

"""Reading Kubernetes manifests, and the shapes validate.py and flags.py share.

- load_documents(): the objects of a multi-document YAML file, parsed as the
  API server's YAML decoder (go-yaml, YAML 1.1) reads them;
- describe(): "Kind/name" for messages;
- pod_of(): the pod template of a workload (Pod, Deployment, DaemonSet, Job,
  CronJob, ...) with its labels and the path to it;
- is_sidecar_snippet() / expand_snippet(): the chart's sidecar ConfigMap
  (label dmuon.io/snippet=sidecar) carries pod-spec.yaml and job-patch.yaml;
  both are turned into a Pod and a Job so that they are checked as such;
- dmuond_init(): the dmuond init container (native sidecar) of a workload.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

# Kinds whose pod template sits at spec.template.
TEMPLATED_KINDS = ("DaemonSet", "Deployment", "StatefulSet", "ReplicaSet", "Job")
# What the sidecar snippet gives containers that have no image of their own
# (the trainer container is the user's).
PLACEHOLDER_IMAGE = "registry.example.com/trainer:latest"
SNIPPET_LABEL = "dmuon.io/snippet"


class _ManifestLoader(yaml.SafeLoader):
    """SafeLoader that, like the API server's decoder, keeps timestamps as
    strings (JSON has no date type) and reads a bare `=` as a string."""


_ManifestLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ManifestLoader.add_constructor(
    "tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node)
)


def load_documents(path: str | Path) -> list[Any]:
    """Every non-empty document of a YAML file (raises yaml.YAMLError)."""
    text = Path(path).read_text(encoding="utf-8")
    return load_text(text)


def load_text(text: str) -> list[Any]:
    """Every non-empty document of a YAML string (raises yaml.YAMLError)."""
    return [doc for doc in yaml.load_all(text, Loader=_ManifestLoader) if doc is not None]


def load_one(text: str) -> Any:
    """The single document of a YAML string (raises yaml.YAMLError)."""
    return yaml.load(text, Loader=_ManifestLoader)


def as_dict(value: Any) -> Obj:
    """value when it is a mapping, else an empty one (for defensive walks of
    objects whose types the schema check reports on its own)."""
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    """value when it is a sequence, else an empty one."""
    return value if isinstance(value, list) else []


def metadata(obj: Any) -> Obj:
    return as_dict(as_dict(obj).get("metadata"))


def labels(obj: Any) -> Obj:
    return as_dict(metadata(obj).get("labels"))


def describe(obj: Any) -> str:
    """Kind/name of an object, for messages."""
    if not isinstance(obj, dict):
        return f"({type(obj).__name__} document)"
    return f"{obj.get('kind', '?')}/{metadata(obj).get('name', '?')}"


@dataclass
class PodTemplate:
    """A workload's pod spec, its pod labels, and the path to the spec."""

    spec: Obj
    labels: Obj
    where: str

    def containers(self) -> list[tuple[str, Obj]]:
        """(field, container) for every init container, then every container."""
        out: list[tuple[str, Obj]] = []
        for field in ("initContainers", "containers"):
            out.extend((field, c) for c in as_list(self.spec.get(field)) if isinstance(c, dict))
        return out

    def port_names(self) -> set[str]:
        return {
            p.get("name")
            for _, c in self.containers()
            for p in as_list(c.get("ports"))
            if isinstance(p, dict) and p.get("name") is not None
        }


def pod_of(obj: Any) -> PodTemplate | None:
    """The pod template of a workload, else None."""
    if not isinstance(obj, dict):
        return None
    kind = obj.get("kind")
    spec = as_dict(obj.get("spec"))
    if kind == "Pod":
        return PodTemplate(spec, labels(obj), "spec")
    if kind in TEMPLATED_KINDS and isinstance(spec.get("template"), dict):
        t = spec["template"]
        return PodTemplate(
            as_dict(t.get("spec")), as_dict(metadata(t).get("labels")), "spec.template.spec"
        )
    if kind == "CronJob" and isinstance(spec.get("jobTemplate"), dict):
        t = as_dict(as_dict(spec["jobTemplate"].get("spec")).get("template"))
        return PodTemplate(
            as_dict(t.get("spec")),
            as_dict(metadata(t).get("labels")),
            "spec.jobTemplate.spec.template.spec",
        )
    return None


def is_sidecar_snippet(obj: Any) -> bool:
    """Whether obj is the chart's sidecar-snippet ConfigMap."""
    return (
        isinstance(obj, dict)
        and obj.get("kind") == "ConfigMap"
        and labels(obj).get(SNIPPET_LABEL) == "sidecar"
    )


@dataclass
class Expanded:
    """An object built from a snippet ConfigMap key, for checking."""

    label: str  # "<configmap name>:<key>"
    key: str
    obj: Obj


def expand_snippet(cm: Obj) -> list[Expanded]:
    """The sidecar ConfigMap's pod-spec.yaml as a Pod and job-patch.yaml as a
    Job, containers without an image given PLACEHOLDER_IMAGE (raises
    yaml.YAMLError, or ValueError when a key does not hold the expected
    shape)."""
    out: list[Expanded] = []
    name = metadata(cm).get("name", "snippet")
    data = as_dict(cm.get("data"))

    def fill(spec: Any, key: str) -> Obj:
        if not isinstance(spec, dict):
            raise ValueError(f"{name}:{key} is not a mapping of pod-spec fields")
        for c in as_list(spec.get("containers")):
            if isinstance(c, dict) and not c.get("image"):
                c["image"] = PLACEHOLDER_IMAGE
        return spec

    if data.get("pod-spec.yaml"):
        spec = fill(load_one(data["pod-spec.yaml"]), "pod-spec.yaml")
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "snippet-check"}, "spec": spec}
        out.append(Expanded(f"{name}:pod-spec.yaml", "pod-spec.yaml", pod))
    if data.get("job-patch.yaml"):
        patch = load_one(data["job-patch.yaml"])
        tspec = as_dict(as_dict(as_dict(as_dict(patch).get("spec")).get("template")).get("spec"))
        if not tspec:
            raise ValueError(f"{name}:job-patch.yaml has no spec.template.spec")
        fill(tspec, "job-patch.yaml")
        tspec.setdefault("restartPolicy", "Never")
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "snippet-check"},
            "spec": patch["spec"],
        }
        out.append(Expanded(f"{name}:job-patch.yaml", "job-patch.yaml", job))
    return out


def dmuond_init(obj: Any) -> Obj | None:
    """The init container named dmuond of a workload, else None."""
    pod = pod_of(obj)
    if pod is None:
        return None
    for c in as_list(pod.spec.get("initContainers")):
        if isinstance(c, dict) and c.get("name") == "dmuond":
            return c
    return None


def without(obj: Obj, key: str) -> Obj:
    """A deep copy of obj without key."""
    out = copy.deepcopy(obj)
    out.pop(key, None)
    return out


def field_path(parts: Any) -> str:
    """Path segments (keys, and ints for list indices) as
    spec.containers[0].name; "(object)" for the object itself."""
    out = ""
    for seg in parts:
        if isinstance(seg, int):
            out += f"[{seg}]"
        else:
            out += f".{seg}" if out else str(seg)
    return out or "(object)"

"""The chart's rendered objects turned into what `podman kube play` runs.

Podman 4.3 plays Pods (and Deployments, ConfigMaps, Secrets, PVCs), not a
DaemonSet or a Job, and it has no native sidecars (an init container with
`restartPolicy: Always` would be waited for forever). So:

  - a DaemonSet or Job becomes the Pod its template describes (what the
    controller would create on one node);
  - a native-sidecar init container becomes the pod's first regular
    container; the ordering the kubelet gives it (started and startup-probed
    before the next container, stopped after the main ones) is left to the
    caller, which gates the trainer on the sidecar's health;
  - objects podman cannot run (Service, ServiceAccount, PodMonitor,
    ServiceMonitor, PodDisruptionBudget, the sidecar snippet's ConfigMap) are
    returned apart, by kind, so the caller can say what was not modelled.

Pure functions over parsed YAML; play.py does the podman work.
"""

from __future__ import annotations

import copy
from typing import Any

Obj = dict[str, Any]

# Kinds podman kube play creates itself.
PLAYABLE = {"Pod", "Secret", "ConfigMap"}


def pod_from_template(obj: Obj, name: str) -> Obj:
    """The Pod a DaemonSet/Job/Deployment's pod template describes."""
    template = obj["spec"]["template"]
    spec = copy.deepcopy(template["spec"])
    meta = copy.deepcopy(template.get("metadata") or {})
    meta["name"] = name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def unsidecar(pod: Obj) -> list[str]:
    """Native sidecars (init containers with restartPolicy Always) moved to
    the front of the regular containers; their names, in order."""
    spec = pod["spec"]
    keep, moved = [], []
    for c in spec.get("initContainers") or []:
        if c.get("restartPolicy") == "Always":
            c = dict(c)
            del c["restartPolicy"]
            moved.append(c)
        else:
            keep.append(c)
    if keep:
        spec["initContainers"] = keep
    else:
        spec.pop("initContainers", None)
    spec["containers"] = moved + list(spec.get("containers") or [])
    return [c["name"] for c in moved]


def split(objects: list[Obj], name: str) -> tuple[list[Obj], dict[str, list[str]]]:
    """(what to play, {kind: [names]} of what podman cannot model). Every
    DaemonSet becomes its Pod, named `name`."""
    play: list[Obj] = []
    left: dict[str, list[str]] = {}
    for obj in objects:
        kind = obj.get("kind", "")
        if kind == "DaemonSet":
            play.append(pod_from_template(obj, name))
        elif (obj.get("metadata", {}).get("labels") or {}).get("dmuon.io/snippet"):
            continue  # the sidecar snippet: expanded into a pod by the caller
        elif kind in PLAYABLE:
            play.append(obj)
        else:
            left.setdefault(kind, []).append(obj["metadata"]["name"])
    return play, left


def probes(container: Obj) -> list[tuple[str, Obj]]:
    """(kind, probe) of a container, in the kubelet's order: startup first,
    then readiness and liveness."""
    return [(k, container[f"{k}Probe"]) for k in ("startup", "readiness", "liveness")
            if container.get(f"{k}Probe")]


def find_container(pod: Obj, name: str) -> Obj:
    for c in pod["spec"].get("containers") or []:
        if c["name"] == name:
            return c
    raise KeyError(f"pod {pod['metadata']['name']} has no container {name}")


def deep_merge(base: Obj, over: Obj) -> Obj:
    """Helm's merge of several -f files: maps merge key by key, anything
    else in `over` replaces."""
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def fill_field_refs(pod: Obj, values: dict[str, str]) -> int:
    """Env vars from the downward API fields podman 4.3 refuses
    (spec.nodeName, metadata.namespace) set to what the kubelet would give:
    values[fieldPath]; how many."""
    n = 0
    spec = pod["spec"]
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        for env in c.get("env") or []:
            ref = (env.get("valueFrom") or {}).get("fieldRef") or {}
            if ref.get("fieldPath") in values:
                del env["valueFrom"]
                env["value"] = values[ref["fieldPath"]]
                n += 1
    return n


def empty_dirs_on_host(pod: Obj, root: str) -> list[str]:
    """Every emptyDir volume replaced by a hostPath directory root/<volume>;
    the directories, for the caller to make as the kubelet makes an
    emptyDir (mode 1777). Why not podman's own: it makes one named volume
    per emptyDir name, shared by every pod and kept after them, and copies
    the image's directory over it on first mount (the image's /dev/shm is
    root 0755, so the non-root daemon could not create its segments)."""
    dirs = []
    for v in pod["spec"].get("volumes") or []:
        if "emptyDir" in v:
            del v["emptyDir"]
            path = f"{root}/{v['name']}"
            v["hostPath"] = {"path": path, "type": "Directory"}
            dirs.append(path)
    return dirs


def secret_volumes(pod: Obj) -> list[tuple[Obj, str, int]]:
    """(volume, secret name, defaultMode) of every Secret volume."""
    return [(v, v["secret"]["secretName"], v["secret"].get("defaultMode", 0o644))
            for v in pod["spec"].get("volumes") or [] if "secret" in v]


def drop_ports(pod: Obj) -> None:
    """Container ports removed (the pod is reached on its IP, as in
    Kubernetes): podman 4.3 publishes every containerPort on the host,
    which Kubernetes does only for a hostPort (two plays, or any process on
    port 50051 or 9464, would collide), and refuses them outright on the
    host network."""
    for c in pod["spec"].get("containers") or []:
        c.pop("ports", None)

"""API-server rules for one object that the OpenAPI schemas do not encode.

- metadata: a DNS-1123 subdomain name (a DNS-1123 label for a Service), a
  DNS-1123 label namespace, label keys and values in Kubernetes' syntax;
- pod templates: unique container, port and volume names; one source per
  volume; mounts that name a volume, at absolute, distinct paths; port
  names in IANA_SVC_NAME syntax and ports in range; restartPolicy only on
  init containers and only Always (native sidecars); probes only on
  restartable init containers, with one handler, named ports that exist and
  successThreshold 1 for liveness and startup; extended resources
  (vendor.com/name) as whole-number limits equal to their requests; unique
  env names; dnsPolicy with hostNetwork; the pod restartPolicy a Job or a
  DaemonSet allows; a selector that matches the pod template's labels.

Each function returns messages "<field path>: <problem>".
"""

from __future__ import annotations

import json
import re
from typing import Any

from manifests import Obj, as_dict, as_list, metadata, pod_of
from schema_check import json_type

DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
IANA_SVC_NAME = re.compile(r"(?=.*[a-z])[a-z0-9]([-a-z0-9]*[a-z0-9])?")
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "StorageClass"}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
PROBE_HANDLERS = ("exec", "httpGet", "tcpSocket", "grpc")


def _is_label(name: Any, limit: int = 63) -> bool:
    return isinstance(name, str) and len(name) <= limit and DNS1123_LABEL.fullmatch(name) is not None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _q(value: Any) -> str:
    """A value as JSON, for messages."""
    return json.dumps(value)


def check_labels(labels: Any, where: str) -> list[str]:
    """Label keys ([prefix/]name) and values in Kubernetes' syntax."""
    errors: list[str] = []
    for key, value in as_dict(labels).items():
        key = str(key)
        prefix, _, name = key.rpartition("/")
        if "/" in prefix or (prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.fullmatch(prefix))):
            errors.append(f"{where}: label key {_q(key)} has an invalid prefix")
        if len(name) > 63 or not LABEL_NAME.fullmatch(name):
            errors.append(f"{where}: label key {_q(key)} is invalid")
        if not isinstance(value, str):
            errors.append(f"{where}: label {key} must be a string, got {json_type(value)}")
        elif len(value) > 63 or not LABEL_VALUE.fullmatch(value):
            errors.append(f"{where}: label {key}={_q(value)} is not a valid label value")
    return errors


def check_metadata(obj: Obj) -> list[str]:
    """metadata.name, metadata.namespace and metadata.labels."""
    errors: list[str] = []
    md = metadata(obj)
    name = md.get("name")
    if not name:
        errors.append("metadata.name: required")
    elif not isinstance(name, str) or len(name) > 253 or not DNS1123_SUBDOMAIN.fullmatch(name):
        errors.append(f"metadata.name {_q(name)}: not a DNS-1123 subdomain")
    if obj.get("kind") == "Service" and name and not _is_label(name):
        errors.append(f"metadata.name {_q(name)}: a Service name must be a DNS-1123 label (<= 63)")
    ns = md.get("namespace")
    if ns is not None and obj.get("kind") not in CLUSTER_SCOPED and not _is_label(ns):
        errors.append(f"metadata.namespace {_q(ns)}: not a DNS-1123 label")
    errors += check_labels(md.get("labels"), "metadata.labels")
    return errors


def _check_probe(at: str, probe: str, p: Obj, sidecar: bool, field: str, own_ports: set[str]) -> list[str]:
    errors: list[str] = []
    if field == "initContainers" and not sidecar:
        errors.append(f"{at}.{probe}: probes are only allowed on restartable init containers")
    handlers = [h for h in PROBE_HANDLERS if p.get(h)]
    if len(handlers) != 1:
        errors.append(f"{at}.{probe}: needs exactly one handler, has {len(handlers)}")
    for h in ("httpGet", "tcpSocket"):
        port = as_dict(p.get(h)).get("port")
        if isinstance(port, str) and not port.isdigit() and port not in own_ports:
            errors.append(f"{at}.{probe}.{h}.port: no container port named {port}")
    if probe in ("livenessProbe", "startupProbe") and p.get("successThreshold", 1) != 1:
        errors.append(f"{at}.{probe}.successThreshold: must be 1")
    if p.get("exec") and not as_list(as_dict(p.get("exec")).get("command")):
        errors.append(f"{at}.{probe}.exec.command: empty")
    return errors


def _check_resources(at: str, resources: Obj) -> list[str]:
    """Extended resources (vendor.com/name, e.g. nvidia.com/gpu): whole
    numbers, and a request, if any, equal to the limit."""
    errors: list[str] = []
    requests = as_dict(resources.get("requests"))
    for name, q in as_dict(resources.get("limits")).items():
        name = str(name)
        if "/" not in name or name.startswith(("kubernetes.io/", "requests.")):
            continue
        whole = (_is_int(q) or (isinstance(q, float) and q.is_integer())
                 or (isinstance(q, str) and q.isdigit()))
        if not whole:
            errors.append(f"{at}.resources.limits.{name}: an extended resource must be a whole number")
        if name in requests and _quantity(requests[name]) != _quantity(q):
            errors.append(f"{at}.resources.requests.{name}: must equal the limit for an extended resource")
    return errors


def _quantity(q: Any) -> str:
    """A quantity as text, 1, 1.0 and "1" alike."""
    if isinstance(q, float) and q.is_integer():
        return str(int(q))
    return str(q)


def _check_container(at: str, field: str, c: Obj, volumes: set[Any], port_names: set[str]) -> list[str]:
    errors: list[str] = []
    if not _is_label(c.get("name")):
        errors.append(f"{at}: name is not a DNS-1123 label")
    if not c.get("image"):
        errors.append(f"{at}: image is required")
    own: set[str] = set()
    for p in as_list(c.get("ports")):
        p = as_dict(p)
        if "name" in p:
            pname = p["name"]
            if not isinstance(pname, str) or len(pname) > 15 or not IANA_SVC_NAME.fullmatch(pname):
                errors.append(f"{at}.ports: {_q(pname)} is not a valid port name (IANA_SVC_NAME, <= 15 chars)")
            if pname in port_names:
                errors.append(f"{at}.ports: duplicate port name {pname} in the pod")
            port_names.add(pname)
            own.add(pname)
        cp = p.get("containerPort")
        if not (_is_int(cp) and 1 <= cp <= 65535):
            errors.append(f"{at}.ports: containerPort {_q(cp)} out of range")
        hp = p.get("hostPort")
        if hp is not None and not (_is_int(hp) and 1 <= hp <= 65535):
            errors.append(f"{at}.ports: hostPort out of range")
    mounts = [as_dict(m) for m in as_list(c.get("volumeMounts"))]
    for m in mounts:
        if m.get("name") not in volumes:
            errors.append(f"{at}.volumeMounts: {m.get('name')} names no volume of the pod")
        if not str(m.get("mountPath") or "").startswith("/"):
            errors.append(f"{at}.volumeMounts.{m.get('name')}: mountPath must be absolute")
    paths = [m.get("mountPath") for m in mounts]
    if len(set(map(str, paths))) != len(paths):
        errors.append(f"{at}.volumeMounts: duplicate mountPath")
    sidecar = field == "initContainers" and c.get("restartPolicy") == "Always"
    if "restartPolicy" in c and not sidecar:
        errors.append(f"{at}.restartPolicy: only init containers may set it, and only to Always (native sidecar)")
    for probe in PROBES:
        if c.get(probe):
            errors += _check_probe(at, probe, as_dict(c[probe]), sidecar, field, own)
    errors += _check_resources(at, as_dict(c.get("resources")))
    env = [as_dict(e).get("name") for e in as_list(c.get("env"))]
    if len(set(map(str, env))) != len(env):
        errors.append(f"{at}.env: duplicate variable")
    return errors


def check_pod(obj: Obj) -> list[str]:
    """The pod template of a workload (nothing for other kinds)."""
    pod = pod_of(obj)
    if pod is None:
        return []
    kind, spec, where = obj.get("kind"), pod.spec, pod.where
    errors: list[str] = []
    if kind != "Pod":
        errors += check_labels(pod.labels, where.removesuffix(".spec") + ".metadata.labels")
    volumes: set[Any] = set()
    for v in as_list(spec.get("volumes")):
        v = as_dict(v)
        vname = v.get("name")
        if vname in volumes:
            errors.append(f"{where}.volumes: duplicate volume {vname}")
        volumes.add(vname)
        if not _is_label(vname):
            errors.append(f"{where}.volumes: {_q(vname)} is not a DNS-1123 label")
        sources = [k for k in v if k != "name"]
        if len(sources) != 1:
            errors.append(f"{where}.volumes.{vname}: needs exactly one volume source, has {len(sources)}")
    if not as_list(spec.get("containers")):
        errors.append(f"{where}.containers: at least one container is required")
    names: set[Any] = set()
    port_names: set[str] = set()
    for field in ("initContainers", "containers"):
        for i, c in enumerate(as_list(spec.get(field))):
            c = as_dict(c)
            at = f"{where}.{field}[{i}]({c.get('name')})"
            if c.get("name") in names:
                errors.append(f"{at}: duplicate container name")
            names.add(c.get("name"))
            errors += _check_container(at, field, c, volumes, port_names)
    dns = spec.get("dnsPolicy")
    if spec.get("hostNetwork") and dns and dns not in ("ClusterFirstWithHostNet", "Default"):
        errors.append(f"{where}.dnsPolicy: with hostNetwork use ClusterFirstWithHostNet")
    if kind in ("Job", "CronJob") and spec.get("restartPolicy") not in ("Never", "OnFailure"):
        errors.append(f"{where}.restartPolicy: a Job's pods need Never or OnFailure")
    if kind == "DaemonSet" and spec.get("restartPolicy") not in (None, "Always"):
        errors.append(f"{where}.restartPolicy: a DaemonSet's pods must use Always")
    match = as_dict(as_dict(as_dict(obj.get("spec")).get("selector")).get("matchLabels"))
    if kind != "Job":
        for k, v in match.items():
            if pod.labels.get(k) != v:
                errors.append(f"spec.selector.matchLabels.{k}={v} does not match the pod template's labels")
    return errors

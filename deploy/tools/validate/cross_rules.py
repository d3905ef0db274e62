"""Rules across the objects of one rendered file (one Helm release).

- no two objects with the same kind, namespace and name;
- a Service's selector matches a pod template of the file, and each named
  targetPort is a container port of the pods it selects;
- a ServiceMonitor's selector matches a Service of the file, and each
  endpoint port is a port name of such a Service;
- a PodMonitor's endpoints name a container port of the pods its selector
  matches (when it matches none here, as in sidecar mode where the trainer
  pods are the user's, nothing is checked);
- a PodDisruptionBudget's selector matches a pod template of the file, and
  it sets at most one of minAvailable and maxUnavailable.

Problems are handed to report(obj, message).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from manifests import Obj, PodTemplate, as_dict, as_list, labels, metadata, pod_of

Report = Callable[[Any, str], None]


def _subset(selector: Any, labels_: Any) -> bool:
    """Whether every key=value of selector is in labels_ (an empty or absent
    selector matches everything, as matchLabels does)."""
    have = as_dict(labels_)
    return all(have.get(k) == v for k, v in as_dict(selector).items())


def _match_labels(obj: Obj) -> Any:
    return as_dict(as_dict(obj.get("spec")).get("selector")).get("matchLabels")


def _has_container_port(pods: list[PodTemplate], name: Any) -> bool:
    return any(name in p.port_names() for p in pods)


def cross_check(objs: list[Any], report: Report) -> None:
    """Checks the rules above over one file's objects."""
    objs = [o for o in objs if isinstance(o, dict)]
    pods = [p for p in (pod_of(o) for o in objs) if p is not None]
    services = [o for o in objs if o.get("kind") == "Service"]
    seen: set[str] = set()
    for o in objs:
        md = metadata(o)
        ident = f"{o.get('kind')}/{md.get('namespace') or ''}/{md.get('name')}"
        if ident in seen:
            report(o, f"duplicate object {ident}")
        seen.add(ident)

    for s in services:
        spec = as_dict(s.get("spec"))
        selector = spec.get("selector")
        if not selector or not pods:
            continue
        selected = [p for p in pods if _subset(selector, p.labels)]
        if not selected:
            report(s, "spec.selector matches no pod template in this render")
            continue
        for port in as_list(spec.get("ports")):
            port = as_dict(port)
            target = port.get("targetPort")
            if isinstance(target, str) and not _has_container_port(selected, target):
                report(s, f"spec.ports.{port.get('name')}: targetPort {target} names no container port "
                          f"of the selected pods")

    for m in (o for o in objs if o.get("kind") == "ServiceMonitor"):
        selector = _match_labels(m)
        selected = [s for s in services if _subset(selector, labels(s))]
        if not selected:
            report(m, "spec.selector matches no Service in this render")
            continue
        names = {as_dict(p).get("name") for s in selected for p in as_list(as_dict(s.get("spec")).get("ports"))}
        for e in as_list(as_dict(m.get("spec")).get("endpoints")):
            port = as_dict(e).get("port")
            if port and port not in names:
                report(m, f"spec.endpoints: port {port} is not a port name of the selected Service")

    for m in (o for o in objs if o.get("kind") == "PodMonitor"):
        selector = _match_labels(m)
        selected = [p for p in pods if _subset(selector, p.labels)]
        if not selected:
            continue  # sidecar mode: the trainer pods live elsewhere
        for e in as_list(as_dict(m.get("spec")).get("podMetricsEndpoints")):
            port = as_dict(e).get("port")
            if port and not _has_container_port(selected, port):
                report(m, f"spec.podMetricsEndpoints: port {port} names no container port of the selected pods")

    for b in (o for o in objs if o.get("kind") == "PodDisruptionBudget"):
        spec = as_dict(b.get("spec"))
        if pods and not any(_subset(_match_labels(b), p.labels) for p in pods):
            report(b, "spec.selector matches no pod template in this render")
        if "minAvailable" in spec and "maxUnavailable" in spec:
            report(b, "spec: minAvailable and maxUnavailable are mutually exclusive")

"""Tests of pods.py on rendered-like objects made per test (no podman):
run by deploy/validate.sh with the other tools' tests."""

from __future__ import annotations

import copy
import random

import pods


def daemonset(rng: random.Random) -> dict:
    port = rng.randint(1024, 65535)
    container = {"name": "dmuond", "image": "x", "ports": [{"containerPort": port}],
                 "env": [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                         {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                         {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                 "startupProbe": {"grpc": {"port": port}}, "livenessProbe": {"exec": {"command": ["true"]}},
                 "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}, {"name": "tls", "mountPath": "/t"}]}
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "ds"},
            "spec": {"template": {"metadata": {"labels": {"a": "b"}},
                                  "spec": {"containers": [container],
                                           "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}},
                                                       {"name": "tls", "secret": {"secretName": "s",
                                                                                  "defaultMode": 0o440}}]}}}}


def test_split_turns_a_daemonset_into_its_pod_and_names_the_rest() -> None:
    ds = daemonset(random.Random())
    svc = {"kind": "Service", "metadata": {"name": "svc"}}
    snippet = {"kind": "ConfigMap", "metadata": {"name": "cm", "labels": {"dmuon.io/snippet": "sidecar"}}}
    mon = {"kind": "PodMonitor", "metadata": {"name": "m"}}
    play, left = pods.split([ds, svc, snippet, mon], "p")
    assert play == [{"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": {"a": "b"}, "name": "p"},
                     "spec": ds["spec"]["template"]["spec"]}]
    assert play[0]["spec"] is not ds["spec"]["template"]["spec"]  # a copy
    assert left == {"Service": ["svc"], "PodMonitor": ["m"]}


def test_unsidecar_moves_only_native_sidecars_first() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {
        "initContainers": [{"name": "setup"}, {"name": "dmuond", "restartPolicy": "Always"}],
        "containers": [{"name": "trainer"}]}}
    assert pods.unsidecar(pod) == ["dmuond"]
    assert pod["spec"] == {"initContainers": [{"name": "setup"}],
                           "containers": [{"name": "dmuond"}, {"name": "trainer"}]}
    plain = {"metadata": {"name": "q"}, "spec": {"containers": [{"name": "c"}]}}
    assert pods.unsidecar(plain) == [] and plain["spec"] == {"containers": [{"name": "c"}]}


def test_field_refs_empty_dirs_secrets_ports_probes() -> None:
    ds = daemonset(random.Random())
    (pod,), _ = pods.split([ds], "p")
    assert pods.fill_field_refs(pod, {"spec.nodeName": "node-1", "metadata.namespace": "ns"}) == 2
    env = pod["spec"]["containers"][0]["env"]
    assert env[:2] == [{"name": "NODE", "value": "node-1"}, {"name": "NS", "value": "ns"}]
    assert env[2] == ds["spec"]["template"]["spec"]["containers"][0]["env"][2]  # podman has metadata.name
    assert pods.empty_dirs_on_host(pod, "/r") == ["/r/shm"]
    assert pod["spec"]["volumes"][0] == {"name": "shm", "hostPath": {"path": "/r/shm", "type": "Directory"}}
    ((vol, name, mode),) = pods.secret_volumes(pod)
    assert (vol["name"], name, mode) == ("tls", "s", 0o440)
    c = pod["spec"]["containers"][0]
    assert [k for k, _ in pods.probes(c)] == ["startup", "liveness"]
    pods.drop_ports(pod)
    assert "ports" not in c


def test_deep_merge_is_helms_values_merge() -> None:
    rng = random.Random()
    base = {"a": {"x": 1, "y": {"z": 2}}, "b": [1, 2], "c": "keep"}
    n = rng.randint(3, 9)
    over = {"a": {"y": {"w": n}}, "b": [n], "d": None}
    merged = pods.deep_merge(copy.deepcopy(base), over)
    assert merged == {"a": {"x": 1, "y": {"z": 2, "w": n}}, "b": [n], "c": "keep", "d": None}

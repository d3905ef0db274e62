#!/usr/bin/env python3
"""Plays the chart's pods with `podman kube play` (deploy/play/play.sh).

    .venv/bin/python deploy/play/play.py --image REF --trainer PATH [--keep]

For the default, sidecar and TLS (tls-exec-probes) profiles of
helm/dmuond/ci/: render with Helm (tools/helm/render.py) with this
machine's values on top (the image REF, no GPU: gpu.count=0,
daemon.devices=cpu, small resources; free host ports where the pod uses the
host's network), turn the objects into what podman runs (pods.py), add the
Secrets the profile names (TLS: a throwaway CA, server and probe
certificates made with openssl; role tokens), `podman kube play` them, and
then do what the kubelet would:

  - every probe of every container, in order (startup until it passes, at
    most failureThreshold x periodSeconds; then readiness and liveness
    once): a gRPC probe is grpc.health.v1.Health/Check with the probe's
    service against the pod's IP and port, SERVING required; an exec probe
    is its command run in the container (`podman exec`), exit 0 required;
  - /metrics scraped on the pod's metrics port (what the ServiceMonitor or
    PodMonitor would scrape);
  - sidecar: the trainer container (the dmuond image running the host's
    client/examples/linear_trainer, mounted) is started only once its
    dmuond sidecar answers health (the kubelet's native-sidecar gate), trains
    a few steps through it, and must exit 0 with its loss down: the updates
    arrived;
  - TLS: a client with the CA and a client certificate but no token is
    refused a status call; with the operator token it gets one.

Prints "ok/FAIL/skip  play <profile>: ..." lines, what podman could not
model, and "play: N passed, M failed, K skipped"; exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

HERE = Path(__file__).resolve().parent
DEPLOY = HERE.parent
sys.path[:0] = [str(HERE), str(DEPLOY / "tools" / "helm"), str(DEPLOY / "tools" / "validate")]

import pods  # noqa: E402
import render  # noqa: E402
from manifests import expand_snippet, is_sidecar_snippet  # noqa: E402
from tls import make_tls  # noqa: E402

import helm_python as helm  # noqa: E402

CHART = DEPLOY / "helm" / "dmuond"
KUBE_VERSION = "v1.29.0"
STARTUP_CAP_S = 60.0  # the startup probe's budget here, whatever the chart allows
TRAINER_BIN = "/opt/dmuon/linear_trainer"
# Pod names are podman-global: a run of another checkout must not collide.
RUN_ID = uuid.uuid4().hex[:8]
# play.sh's run id: every pod carries dmuon.run=<it>, and play.sh removes
# them all on exit, also when this process is killed.
RUN_LABEL = os.environ.get("DMUON_RUN_ID", f"play-{RUN_ID}")
TOKENS = {"operator": "play-operator-token", "trainer": "play-trainer-token"}


class Report:
    """ok/FAIL/skip lines and their counts."""

    def __init__(self) -> None:
        self.counts = {"ok": 0, "FAIL": 0, "skip": 0}

    def line(self, status: str, text: str, detail: str = "") -> bool:
        self.counts[status] += 1
        print(f"{status:5} {text}")
        lines = detail.strip().splitlines()
        for d in lines[:6] + (["..."] if len(lines) > 16 else []) + lines[max(6, len(lines) - 10):]:
            print(f"      {d}")
        sys.stdout.flush()
        return status == "ok"

    def check(self, cond: bool, text: str, detail: str = "") -> bool:
        return self.line("ok" if cond else "FAIL", text, "" if cond else detail)


def podman(*args: str, check: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check, timeout=timeout)


def free_ports(n: int) -> list[int]:
    """n distinct free ports: every socket is held until all are chosen (one
    released at once could be chosen again)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def machine_values(image: str) -> dict[str, Any]:
    """This machine's values over any profile: the local image, no GPU."""
    repo, tag = image.rsplit(":", 1)
    return {"image": {"repository": repo, "tag": tag, "digest": ""},
            "gpu": {"count": 0}, "daemon": {"devices": "cpu"},
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}}


def rendered(profile: str, extra: dict[str, Any]) -> list[dict]:
    """The profile's objects, rendered by Helm with `extra` values on top."""
    text = (CHART / "ci" / f"{profile}-values.yaml").read_text(encoding="utf-8")
    values = pods.deep_merge(helm.values_from_yaml(text), extra)
    manifests, _ = render.render(CHART, values, kube_version=KUBE_VERSION, name="dmuond")
    return [o for o in yaml.safe_load_all(manifests) if o]


def grpc_probe(address: str, service: str, timeout: float) -> tuple[bool, str]:
    """The kubelet's gRPC probe: Health/Check(service) must say SERVING."""
    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                     timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    return status == "SERVING", status


def exec_probe(container: str, command: list[str], timeout: float) -> tuple[bool, str]:
    """The kubelet's exec probe: the command in the container, exit 0."""
    try:
        r = podman("exec", container, *command, timeout=timeout + 5)
    except subprocess.TimeoutExpired:
        return False, f"no answer in {timeout} s"
    return r.returncode == 0, (r.stdout + r.stderr).strip() or f"exit {r.returncode}"


def probe_once(probe: dict, container: str, ip: str) -> tuple[bool, str]:
    timeout = float(probe.get("timeoutSeconds", 1))
    if "grpc" in probe:
        g = probe["grpc"]
        return grpc_probe(f"{ip}:{g['port']}", g.get("service", ""), timeout)
    if "exec" in probe:
        return exec_probe(container, probe["exec"]["command"], timeout)
    return False, f"probe kind {sorted(probe)} not played"


def run_probes(rep: Report, label: str, pod: dict, ip: str, names: list[str]) -> None:
    """Every probe of the named containers, as the kubelet orders them."""
    pod_name = pod["metadata"]["name"]
    for name in names:
        c = pods.find_container(pod, name)
        for kind, probe in pods.probes(c):
            how = "gRPC" if "grpc" in probe else "exec"
            budget = min(STARTUP_CAP_S, probe.get("failureThreshold", 3) * probe.get("periodSeconds", 10))
            deadline = time.monotonic() + (budget if kind == "startup" else 0)
            while True:
                ok, why = probe_once(probe, f"{pod_name}-{name}", ip)
                if ok or time.monotonic() >= deadline:
                    break
                time.sleep(0.3)
            svc = probe.get("grpc", {}).get("service")
            rep.check(ok, f"{label}: {name} {kind} probe ({how}{f', service {svc}' if svc else ''}): {why}",
                      podman("logs", f"{pod_name}-{name}").stderr)


def pod_ip(pod: dict) -> str:
    if pod["spec"].get("hostNetwork"):
        return "127.0.0.1"
    infra = podman("pod", "inspect", pod["metadata"]["name"], "--format", "{{.InfraContainerID}}").stdout.strip()
    return podman("inspect", infra, "--format",
                  "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}").stdout.strip()


def scrape(rep: Report, label: str, ip: str, port: int) -> None:
    try:
        body = urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=5).read().decode()
        rep.check("dmuon_sessions" in body, f"{label}: /metrics on {port} has dmuon_ series", body[:500])
    except OSError as e:
        rep.check(False, f"{label}: /metrics on {port}", str(e))


def secret_dirs(pod: dict, secrets: dict[str, dict[str, bytes]], work: Path) -> None:
    """Secret volumes as host directories of the Secret's files, owned and
    moded as the kubelet writes them (defaultMode, group fsGroup): podman
    4.3's own secret volumes crash kube play (VolumeFromSecret, nil pointer)."""
    group = (pod["spec"].get("securityContext") or {}).get("fsGroup", 0)
    for volume, name, mode in pods.secret_volumes(pod):
        d = work / "secrets" / pod["metadata"]["name"] / name
        d.mkdir(parents=True, exist_ok=True)
        for file, data in secrets[name].items():
            (d / file).write_bytes(data)
            os.chown(d / file, 0, group)
            os.chmod(d / file, mode)
        del volume["secret"]
        volume["hostPath"] = {"path": str(d), "type": "Directory"}


def play(rep: Report, label: str, objects: list[dict], work: Path,
         then: Callable[[dict, str], None], secrets: dict[str, dict[str, bytes]] | None = None) -> None:
    """kube play the objects, run `then(pod, ip)`, always take them down."""
    file = work / f"{label.replace(' ', '-')}.yaml"
    pod = next(o for o in objects if o["kind"] == "Pod")
    pod["metadata"].setdefault("labels", {})["dmuon.run"] = RUN_LABEL
    # Downward API fields podman refuses, filled as the kubelet would.
    pods.fill_field_refs(pod, {"spec.nodeName": socket.gethostname(), "metadata.namespace": "default"})
    secret_dirs(pod, secrets or {}, work)
    pods.drop_ports(pod)
    # emptyDirs as the kubelet makes them: mode 1777. Not modelled: medium
    # Memory (a disk directory here) and sizeLimit.
    for d in pods.empty_dirs_on_host(pod, str(work / "emptydir" / pod["metadata"]["name"])):
        os.makedirs(d)
        os.chmod(d, 0o1777)
    try:
        file.write_text(yaml.safe_dump_all(objects, sort_keys=False), encoding="utf-8")
        r = podman("kube", "play", str(file), timeout=180)
        if not rep.check(r.returncode == 0, f"{label}: podman kube play ({len(objects)} objects)",
                         r.stdout + r.stderr):
            return
        then(pod, pod_ip(pod))
    finally:
        if not os.environ.get("DMUON_PLAY_KEEP"):
            podman("kube", "down", str(file), timeout=120)


def not_modelled(rep: Report, label: str, left: dict[str, list[str]]) -> None:
    for kind, names in sorted(left.items()):
        rep.line("skip", f"{label}: {kind} {', '.join(names)}: podman has no {kind}")


def default_profile(rep: Report, image: str, work: Path, _trainer: Path) -> None:
    """The chart's defaults: the DaemonSet's pod on podman's bridge network."""
    label = "play default"
    play_objs, left = pods.split(rendered("default", machine_values(image)), f"dmuond-play-default-{RUN_ID}")
    not_modelled(rep, label, left)

    def then(pod: dict, ip: str) -> None:
        run_probes(rep, label, pod, ip, ["dmuond"])
        scrape(rep, label, ip, 9464)

    play(rep, label, play_objs, work, then)


def tls_profile(rep: Report, image: str, work: Path, _trainer: Path) -> None:
    """mTLS + role tokens, exec probes (dmuonctl with a client certificate),
    host network on free ports."""
    label = "play tls-exec-probes"
    grpc_port, metrics_port = free_ports(2)
    extra = pods.deep_merge(machine_values(image), {"ports": {"grpc": grpc_port, "metrics": metrics_port}})
    objs = rendered("tls-exec-probes", extra)
    play_objs, left = pods.split(objs, f"dmuond-play-tls-{RUN_ID}")
    not_modelled(rep, label, left)
    files = make_tls(work / "tls", "dmuond")
    tokens = "".join(f"{role} {tok} play-{role}\n" for role, tok in TOKENS.items()).encode()
    secrets = {"dmuond-tls": files, "dmuond-tokens": {"tokens": tokens}}

    def then(pod: dict, ip: str) -> None:
        run_probes(rep, label, pod, ip, ["dmuond"])
        ctl = [os.environ.get("DMUONCTL", "dmuonctl"), f"--server=127.0.0.1:{grpc_port}",
               f"--tls-ca-file={work}/tls/ca.crt", f"--tls-cert-file={work}/tls/probe.crt",
               f"--tls-key-file={work}/tls/probe.key", "--tls-server-name=dmuond"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DMUON_TOKEN")}
        anon = subprocess.run([*ctl, "status"], capture_output=True, text=True, env=env, timeout=30)
        rep.check(anon.returncode != 0 and "requires a token" in anon.stderr + anon.stdout,
                  f"{label}: status without a token refused (UNAUTHENTICATED, 16)", anon.stdout + anon.stderr)
        env["DMUON_TOKEN"] = TOKENS["operator"]
        op = subprocess.run([*ctl, "status"], capture_output=True, text=True, env=env, timeout=30)
        rep.check(op.returncode == 0, f"{label}: status with the operator token over mTLS", op.stdout + op.stderr)
        scrape(rep, label, ip, metrics_port)

    play(rep, label, play_objs, work, then, secrets)


def trainer_container(pod: dict, trainer: Path, steps: int) -> None:
    """The snippet's trainer container given an image and a command: wait for
    the sidecar's health (the kubelet starts it only then), then train."""
    c = pods.find_container(pod, "trainer")
    dmuond = pods.find_container(pod, "dmuond")
    c["image"] = dmuond["image"]
    wait = ("i=0; until dmuonctl --server=$DMUON_SERVER health >/dev/null 2>&1; do "
            "i=$((i+1)); [ $i -gt 300 ] && exit 3; sleep 0.2; done")
    c["command"] = ["sh", "-c", f"{wait}; exec {TRAINER_BIN} --server=$DMUON_SERVER --steps={steps}"]
    c.setdefault("volumeMounts", []).append({"name": "play-trainer", "mountPath": TRAINER_BIN, "readOnly": True})
    pod["spec"]["volumes"].append({"name": "play-trainer", "hostPath": {"path": str(trainer), "type": "File"}})


def sidecar_profile(rep: Report, image: str, work: Path, trainer: Path) -> None:
    """The snippet's Job as a pod: dmuond as a (de-natived) sidecar and a
    trainer that trains through it."""
    label = "play sidecar"
    objs = rendered("sidecar", machine_values(image))
    cm = next(o for o in objs if is_sidecar_snippet(o))
    job = next(x.obj for x in expand_snippet(cm) if x.obj["kind"] == "Job")
    pod = pods.pod_from_template(job, f"dmuond-play-sidecar-{RUN_ID}")
    moved = pods.unsidecar(pod)
    rep.check(moved == ["dmuond"], f"{label}: dmuond is the pod's native sidecar", str(moved))
    trainer_container(pod, trainer, steps=20)
    _, left = pods.split(objs, "unused")
    not_modelled(rep, label, left)

    def then(pod: dict, ip: str) -> None:
        run_probes(rep, label, pod, ip, ["dmuond"])
        name = f"{pod['metadata']['name']}-trainer"
        try:
            code = podman("wait", name, timeout=180).stdout.strip()
        except subprocess.TimeoutExpired:
            code = "timeout"
        out = podman("logs", name)
        log = out.stdout + out.stderr
        m = re.search(r"done: loss ([0-9.]+) -> ([0-9.]+)", log)
        via = re.search(r"\((\w+) transport\)", log)
        rep.check(code == "0" and m is not None and float(m.group(2)) < 0.5 * float(m.group(1)),
                  f"{label}: trainer trained through its dmuond over {via.group(1) if via else '?'} "
                  f"({m.group(0) if m else 'no result'})",
                  f"exit {code}\n{log}")
        run_probes(rep, label + " after training", pod, ip, ["dmuond"])
        scrape(rep, label, ip, 9464)

    play(rep, label, [pod], work, then)


PROFILES = {"default": default_profile, "sidecar": sidecar_profile, "tls-exec-probes": tls_profile}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", required=True, help="the dmuond image (CPU), e.g. localhost/dmuond:dev")
    ap.add_argument("--trainer", required=True, type=Path, help="client/examples/linear_trainer")
    ap.add_argument("profiles", nargs="*", metavar="PROFILE", help=f"of {sorted(PROFILES)} (default: all)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.profiles) - set(PROFILES))
    if unknown:
        ap.error(f"unknown profile(s) {unknown}: choose from {sorted(PROFILES)}")
    rep = Report()
    with tempfile.TemporaryDirectory(prefix="dmuon-play-") as tmp:
        for name in args.profiles or list(PROFILES):
            try:
                PROFILES[name](rep, args.image, Path(tmp), args.trainer.resolve())
            except (render.RenderError, subprocess.SubprocessError, OSError, KeyError, StopIteration) as e:
                rep.line("FAIL", f"play {name}: {type(e).__name__}: {e}")
    c = rep.counts
    print(f"play: {c['ok']} passed, {c['FAIL']} failed, {c['skip']} skipped")
    return 1 if c["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

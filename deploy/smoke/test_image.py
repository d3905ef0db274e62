"""The dmuond images, run for real under podman (issue 26, item 2).

Each image: its labels and user; every library its binaries load resolves
inside it, and it holds no library they do not load. The CPU image, run as
the chart's DaemonSet runs it (containers.Dmuond: host network, host IPC and
/dev/shm, read-only root, non-root, a state volume): the host's dmuonctl
sees it SERVING; a trainer on the host trains through it over `inline` and
over `shm` and matches torch.optim.Muon with fp32 Newton-Schulz (+ AdamW
for the biases) to 1e-5 per parameter per step; SIGTERM drains and
snapshots to the volume, and a second container on it resumes the job bit
for bit. The CUDA image, on this machine without a GPU: `--devices=cuda`
exits naming the missing device; the default `--devices=auto` warns and
serves on the CPU.
"""

from __future__ import annotations

import copy
import json
import random
import subprocess
from pathlib import Path

import pytest
import torch

from containers import STATE, Dmuond, Registry, podman, run_labels
from dmuon import AdamWOptions, DaemonOptions
from dmuon.optim import DMuon
from helpers import MLP, loss_of, mlp_batch, rel_err, train
from torch_ref import ADAMW, MUON, TOL, muon_adamw_run

MUON_NAMES = ["fc1.weight", "fc2.weight", "fc3.weight"]  # MLP's matrices; biases: AdamW
STEPS = 4


def _version(root: Path) -> str:
    for line in (root / "base" / "protocol.h").read_text().splitlines():
        if "kDmuonVersion[]" in line:
            return line.split('"')[1]
    raise AssertionError("no kDmuonVersion in base/protocol.h")


@pytest.fixture(scope="module")
def daemon(image: str, tmp_path_factory: pytest.TempPathFactory):
    """One CPU-image container for the training tests."""
    d = Dmuond(image, None, tmp_path_factory.mktemp("run"))
    yield d
    d.remove()


@pytest.mark.parametrize("which", ["image", "cuda_image"])
def test_labels_and_user(which: str, request: pytest.FixtureRequest, root: Path) -> None:
    ref = request.getfixturevalue(which)
    info = podman("image", "inspect", "--format",
                  '{{json .Labels}}\t{{.Config.User}}\t{{json .Config.Entrypoint}}', ref).stdout
    labels, user, entrypoint = info.strip().split("\t")
    labels = json.loads(labels)
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True, timeout=30).stdout.strip()
    assert labels["org.opencontainers.image.version"] == _version(root)
    assert labels["org.opencontainers.image.revision"].split("-")[0] == head, labels
    assert labels["org.opencontainers.image.source"], labels
    assert user == "65532:65532"
    assert json.loads(entrypoint) == ["dmuond"]


LDD = r"""
set -eu
ldd /usr/local/bin/dmuond /usr/local/bin/dmuonctl > /tmp/ldd
if grep 'not found' /tmp/ldd; then exit 1; fi
# Every bundled library is one the binaries load.
for f in /opt/dmuon/lib/*; do
  grep -q " => $f " /tmp/ldd || { echo "unused: $f"; exit 1; }
done
echo "libraries: $(ls /opt/dmuon/lib | wc -l) bundled"
"""


@pytest.mark.parametrize("which", ["image", "cuda_image"])
def test_ldd_inside_the_image(which: str, request: pytest.FixtureRequest) -> None:
    ref = request.getfixturevalue(which)
    # /tmp is a tmpfs: the root file system stays read-only.
    r = podman("run", "--rm", *run_labels(), "--network=host", "--read-only", "--tmpfs", "/tmp",
               "--entrypoint", "sh", ref, "-c", LDD, check=False, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "libraries:" in r.stdout


LICENCES = "ls /opt/dmuon/lib; echo ---; cd /usr/share/doc/dmuon/licenses && find . -type f -size +0"
# The NVIDIA libraries (not Debian's): the wheel whose licence folder holds
# their licence (bundle-libs.sh); the static CUDA runtime linked into
# dmuond_cuda brings nvidia_cuda_runtime's.
NVIDIA = {"libcublas": "nvidia_cublas", "libcublasLt": "nvidia_cublas", "libnccl": "nvidia_nccl"}


def _packages_of(libs: list[str]) -> dict[str, set[str]]:
    """Debian's packages shipping each library name on this host (dpkg -S)."""
    r = subprocess.run(["dpkg", "-S", *[f"*/{lib}" for lib in libs]], capture_output=True, text=True,
                       timeout=60, check=False)
    found: dict[str, set[str]] = {}
    for line in r.stdout.splitlines():
        pkgs, path = line.split(": ", 1)
        for pkg in pkgs.split(", "):
            found.setdefault(path.rsplit("/", 1)[1], set()).add(pkg.split(":")[0])
    return found


@pytest.mark.parametrize("which", ["image", "cuda_image"])
def test_every_bundled_library_has_its_licence(which: str, request: pytest.FixtureRequest) -> None:
    """The issue's "with their licences": each library under /opt/dmuon/lib
    has a non-empty licence in /usr/share/doc/dmuon/licenses/<package>/ (the
    Debian package's copyright; the NVIDIA wheel's licences), and the CUDA
    image the CUDA runtime's."""
    r = podman("run", "--rm", *run_labels(), "--network=host", "--read-only", "--entrypoint", "sh",
               request.getfixturevalue(which), "-c", LICENCES, check=False, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    libs_text, files_text = r.stdout.split("---\n")
    libs = libs_text.split()
    folders = {f.split("/")[1] for f in files_text.split()}
    packages = _packages_of([lib for lib in libs if lib.split(".so")[0] not in NVIDIA])
    missing = []
    for lib in libs:
        wheel = NVIDIA.get(lib.split(".so")[0])
        if wheel:
            ok = any(f.startswith(wheel) for f in folders)
        else:
            ok = bool(packages.get(lib, set()) & folders)
        if not ok:
            missing.append(f"{lib} (package {wheel or sorted(packages.get(lib, set())) or 'unknown'})")
    if which == "cuda_image" and not any(f.startswith("nvidia_cuda_runtime") for f in folders):
        missing.append("the CUDA runtime (nvidia_cuda_runtime)")
    assert not missing, f"no licence for {missing}; licence folders: {sorted(folders)}"
    assert len(libs) > 10, libs


def test_push_and_pull_through_a_registry(image: str, image_ref: str, tmp_path: Path) -> None:
    """deploy/README.md's push, against a real registry on loopback: the
    image pulled back is the image pushed (the same image id)."""
    registry = Registry(tmp_path / "registry")
    target = f"{registry.address}/dmuon/dmuond:{image_ref.rsplit(':', 1)[1]}"
    try:
        podman("push", "--quiet", "--tls-verify=false", image, target, timeout=300)
        podman("pull", "--quiet", "--tls-verify=false", target, timeout=300)
        ids = [podman("image", "inspect", "--format", "{{.Id}}", ref).stdout.strip()
               for ref in (image, target)]
        assert ids[0] == ids[1], ids
    finally:
        podman("rmi", target, check=False, timeout=60)
        registry.close()


def test_host_dmuonctl_sees_it_serving(daemon: Dmuond, root: Path) -> None:
    r = subprocess.run([str(root / "bazel-bin" / "daemon" / "dmuonctl"),
                        f"--server={daemon.address}", "health"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SERVING" in r.stdout and "NOT_SERVING" not in r.stdout, r.stdout


def _dmuon(model: torch.nn.Module, address: str, transport: str, job_id: str,
           **daemon: object) -> DMuon:
    return DMuon(model, **MUON, adamw_options=AdamWOptions(**ADAMW),
                 daemon_options=DaemonOptions(address, transport=transport, job_id=job_id,
                                              **daemon))


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_trains_like_torch_muon(daemon: Dmuond, transport: str) -> None:
    seed = random.randrange(1 << 30)  # fresh inputs every run
    torch.manual_seed(seed)
    model = MLP()
    reference = copy.deepcopy(model)
    params, _, _ = muon_adamw_run(
        reference, MUON_NAMES, STEPS,
        lambda m, s: loss_of(m, mlp_batch(s, seed=seed)).backward())
    opt = _dmuon(model, daemon.address, transport, f"smoke-{transport}-{seed}")
    assert opt.transport == transport
    try:
        for s in range(STEPS):
            loss_of(model, mlp_batch(s, seed=seed)).backward()
            opt.step()
            opt.zero_grad()
            for name, p in model.named_parameters():
                err = rel_err(p.detach(), params[s][name])
                assert err < TOL, f"seed {seed}, step {s + 1}, {name}: {err:.2e}"
    finally:
        opt.close()


def _all_muon(seed: int) -> torch.nn.Module:
    # Every parameter a Muon matrix: dmuond holds the whole optimizer state,
    # so a run resumed from its snapshot equals an uninterrupted one exactly.
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 48, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(48, 10, bias=False))


def test_sigterm_snapshots_and_a_new_container_resumes(image: str, tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    batch = lambda s: mlp_batch(s, seed=seed)  # noqa: E731
    state = tmp_path / "state"
    first = Dmuond(image, state, tmp_path / "run1")
    try:
        want = _all_muon(seed)
        opt = _dmuon(want, first.address, "shm", "smoke-straight")
        train(want, opt, 4, batch)
        opt.close()
        model = _all_muon(seed)
        opt = _dmuon(model, first.address, "shm", "smoke-resumed")
        train(model, opt, 2, batch)
        opt.close()
        status = first.stop()  # SIGTERM: drain, final snapshot
        logs = first.logs()
    finally:
        first.remove()
    assert status == 0, logs
    assert "draining" in logs and f"state snapshotted to {STATE}" in logs, logs
    assert list(state.glob("job-*.dmst")), sorted(p.name for p in state.iterdir())
    second = Dmuond(image, state, tmp_path / "run2")
    try:
        opt = _dmuon(model, second.address, "shm", "smoke-resumed", resume=True)
        assert opt.session.step == 3
        train(model, opt, 2, batch, start=2)
        opt.close()
    finally:
        second.remove()
    for (name, a), b in zip(want.named_parameters(), model.parameters()):
        assert torch.equal(a, b), f"seed {seed}: {name} differs after the resume"


def test_cuda_image_names_the_missing_gpu(cuda_image: str) -> None:
    r = podman("run", "--rm", *run_labels(), "--network=host", "--read-only", cuda_image,
               "--listen=127.0.0.1:0", "--devices=cuda", check=False, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "no usable CUDA device" in out and "--devices=cpu" in out, out


def test_cuda_image_without_a_gpu_serves_on_the_cpu(cuda_image: str, tmp_path: Path) -> None:
    d = Dmuond(cuda_image, None, tmp_path / "run", devices="auto")
    try:
        logs = d.logs()
        assert "--devices=auto: no usable GPU" in logs and "using the CPU" in logs, logs
        assert d.stop() == 0
    finally:
        d.remove()

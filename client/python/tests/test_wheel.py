"""The wheel of make_wheel.py (what `./dmuon wheel` runs), installed the way
users install it. One wheel is built into a temporary directory from the
Bazel output (never dist/), then:

test_wheel_file
    its name (cp311, manylinux_2_XX for XX <= this glibc), metadata, and the
    file name and count of dmuon.libs/ that client/python/README.md gives.
test_clean_venv_without_debian_libraries
    a venv made by /usr/bin/python3 -m venv, `pip install` of the wheel
    alone (numpy comes from PyPI as its dependency). Statically: every ELF
    file of the installed package (the extension, dmuond, dmuonctl and each
    of dmuon.libs/) finds each DT_NEEDED inside the package through its
    $ORIGIN-relative RPATH, except the base system (glibc, libstdc++,
    libgcc_s, libz); no RPATH points anywhere else; no versioned symbol is
    newer than the tag's glibc or GCC 12's libstdc++. Then at run time, with
    LD_LIBRARY_PATH unset and, where the kernel lets this user make a user
    and mount namespace (unshare -rm), Debian's gRPC, protobuf, Abseil, upb,
    re2, c-ares, OpenSSL, OpenBLAS, gfortran, spdlog, fmt, prometheus-cpp
    and civetweb hidden from the dynamic linker (control: the Bazel-built
    dmuond must then fail to start): the console scripts `dmuond --help` and
    `dmuonctl --help`; `import dmuon`; orthogonalize against numpy's SVD; a
    LocalDaemon from the wheel's dmuond serving a session (checked against
    the SVD as well) and answering `dmuonctl health`; and in /proc/PID/maps
    the daemon maps no library from outside the package but the base system,
    the interpreter none of Debian's copies.
test_training_with_torch_from_the_wheel
    in the project venv (PyPI torch): `pip install --no-deps --target`, then
    3 steps of DMuon with server="auto" (the wheel's dmuond) match the
    reference Muon within 1e-5.
test_symbols_with_the_wheels_extension
    test_symbols.py's check (torch, grpcio and dmuon in one process, no
    symbol bound across) on the wheel's extension.

Slow: 35 s on 2 cores (60 s with the machine busy), most of it building the
wheel (auditwheel repair: 12-16 s), the clean venv (5-8 s, numpy from pip's
cache) and the interpreters that import torch.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

import test_symbols

# Builds a 27 MB wheel and a venv: more than pytest.ini's 180 s on a busy
# machine could take; that limit is for hangs.
pytestmark = pytest.mark.timeout(600)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
MAKE_WHEEL = ROOT / "client" / "python" / "make_wheel.py"
PY = f"cp{sys.version_info.major}{sys.version_info.minor}"

# What the package may take from the system (sonames).
BASE = {"libc.so.6", "libm.so.6", "libmvec.so.1", "libpthread.so.0", "libdl.so.2",
        "librt.so.1", "ld-linux-x86-64.so.2", "libstdc++.so.6", "libgcc_s.so.1",
        "libz.so.1"}
BASE_FILE = re.compile(r"^(libc|libm|libmvec|libpthread|libdl|librt|ld-linux-x86-64|"
                       r"libstdc\+\+|libgcc_s|libz)[-.]")
# GCC 12's libstdc++ and libgcc_s (make_wheel.py's docstring: the README's
# "libstdc++ from GCC >= 12").
MAX_VERSION = {"GLIBCXX": (3, 4, 30), "CXXABI": (1, 3, 13), "GCC": (12, 0, 0)}
# Debian's copies of what the wheel bundles, hidden in the namespace.
HIDE = re.compile(r"^(lib(grpc|gpr|upb|address_sorting|protobuf|protoc|absl_|re2|cares|"
                  r"openblas|blas|lapack|gfortran|quadmath|spdlog|fmt|prometheus|civetweb|"
                  r"ssl|crypto)|openblas|blas|lapack)")
# ... minus OpenSSL, which the interpreter itself may load (hashlib, ssl).
DEBIAN_COPY = re.compile(r"^lib(grpc|gpr|upb|address_sorting|protobuf|absl_|re2|cares|"
                         r"openblas|gfortran|quadmath|spdlog|fmt|prometheus|civetweb)")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHOME",
                        "VIRTUAL_ENV", "DMUON_DMUOND", "DMUON_EXTENSION_DIR")}
    env.update(extra)
    return env


def run(cmd, timeout=120, **kw):
    kw.setdefault("env", clean_env())
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          timeout=timeout, **kw)


def ok(r):
    assert r.returncode == 0, f"{r.args}: exit {r.returncode}\n{r.stdout}\n{r.stderr[-6000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    ok(run([sys.executable, MAKE_WHEEL, "--out", out], timeout=400))
    (path,) = out.glob("dmuon-*.whl")
    return path


@pytest.fixture(scope="module")
def clean_venv(wheel, tmp_path_factory):
    """(venv, its site-packages) with the wheel pip-installed."""
    venv = tmp_path_factory.mktemp("clean") / "venv"
    ok(run(["/usr/bin/python3", "-m", "venv", venv]))
    ok(run([venv / "bin" / "python", "-m", "pip", "install", "--disable-pip-version-check",
            "--quiet", wheel], timeout=400))
    site = ok(run([venv / "bin" / "python", "-c",
                   "import sysconfig; print(sysconfig.get_paths()['platlib'])"]))
    return venv, Path(site.stdout.strip())


@pytest.fixture(scope="module")
def target(wheel, tmp_path_factory):
    """A directory with the wheel installed by the project venv's pip."""
    t = tmp_path_factory.mktemp("target")
    ok(run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--quiet",
            "--no-deps", "--target", t, wheel], timeout=300))
    return t


def test_wheel_file(wheel):
    m = re.fullmatch(rf"dmuon-[^-]+-{PY}-{PY}-manylinux_2_(\d+)_x86_64\.whl", wheel.name)
    assert m, wheel.name
    glibc = tuple(int(x) for x in os.confstr("CS_GNU_LIBC_VERSION").split()[1].split("."))
    assert (2, int(m.group(1))) <= glibc[:2]
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = z.read(f"{info}/METADATA").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
        modes = {n: z.getinfo(n).external_attr >> 16 for n in names}
    for f in ("dmuon/_dmuon.so", "dmuon/bin/dmuond", "dmuon/bin/dmuonctl", "dmuon/_cli.py",
              "dmuon/optim.py", "dmuon/torch.py", "dmuon/integrations/__init__.py",
              "dmuon/integrations/torchtitan.py"):
        assert f in names, f
    for f in ("dmuon/bin/dmuond", "dmuon/bin/dmuonctl"):
        assert modes[f] & 0o111, f
    libs = [n for n in names if n.startswith("dmuon.libs/") and not n.endswith("/")]
    assert any("libgrpc-" in n for n in libs) and any("libopenblas" in n for n in libs), libs
    # client/python/README.md names the wheel's file and counts its libraries:
    # keep both true.
    readme = (ROOT / "client" / "python" / "README.md").read_text()
    named = set(re.findall(r"dist/(dmuon-[^\s'\[]+\.whl)", readme))
    assert named == {wheel.name}, (named, wheel.name)
    said = re.search(r"\| `dmuon\.libs/` \| (\d+) shared libraries", readme)
    assert said and int(said.group(1)) == len(libs), (
        f"client/python/README.md says {said and said.group(1)} libraries in dmuon.libs/, "
        f"the wheel has {len(libs)}")
    py = sys.version_info
    assert f"Requires-Python: =={py.major}.{py.minor}.*\n" in meta
    assert "Requires-Dist: numpy\n" in meta
    assert 'Requires-Dist: torch>=2.9; extra == "torch"\n' in meta
    assert 'Requires-Dist: torchtitan==0.3.0; extra == "torchtitan"\n' in meta
    assert "dmuond = dmuon._cli:dmuond" in entry_points
    assert "dmuonctl = dmuon._cli:dmuonctl" in entry_points


# --- the static check ---------------------------------------------------------

def elf_files(root):
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            with open(p, "rb") as f:
                if f.read(4) == b"\x7fELF":
                    yield p


def dynamic(path):
    """(DT_NEEDED list, RPATH/RUNPATH directories) from readelf."""
    out = ok(run(["readelf", "-dW", path])).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    dirs = []
    for d in re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[([^\]]*)\]", out):
        dirs += [x.replace("${ORIGIN}", "$ORIGIN") for x in d.split(":") if x]
    return needed, dirs


def version_needs(path):
    """{(library, version)} of the .gnu.version_r section."""
    needs, lib, inside = set(), None, False
    for line in ok(run(["readelf", "-VW", path])).stdout.splitlines():
        if line.startswith("Version needs section"):
            inside = True
        elif line.startswith("Version "):
            inside = False
        elif inside and "File:" in line:
            lib = re.search(r"File: (\S+)", line).group(1)
        elif inside and "Name:" in line:
            needs.add((lib, re.search(r"Name: (\S+)", line).group(1)))
    return needs


def check_elf_files(site, glibc_minor):
    pkg, libs = site / "dmuon", site / "dmuon.libs"
    inside = (str(pkg) + os.sep, str(libs) + os.sep)
    files = list(elf_files(pkg)) + list(elf_files(libs))
    names = {str(p.relative_to(site)) for p in files}
    assert {"dmuon/_dmuon.so", "dmuon/bin/dmuond", "dmuon/bin/dmuonctl"} <= names, names
    problems = []
    for path in files:
        needed, dirs = dynamic(path)
        resolved_dirs = []
        for d in dirs:
            if not d.startswith("$ORIGIN"):
                problems.append(f"{path}: RPATH {d} is not relative to $ORIGIN")
                continue
            r = os.path.normpath(d.replace("$ORIGIN", str(path.parent)))
            if not (r + os.sep).startswith(inside):
                problems.append(f"{path}: RPATH {d} leaves the package ({r})")
            resolved_dirs.append(r)
        for soname in needed:
            if soname in BASE:
                continue
            found = [os.path.join(d, soname) for d in resolved_dirs
                     if os.path.isfile(os.path.join(d, soname))]
            if not found:
                problems.append(f"{path}: {soname} is neither in the package nor a base "
                                "system library")
            elif not os.path.realpath(found[0]).startswith(inside):
                problems.append(f"{path}: {soname} resolves to {found[0]}")
        for lib, ver in version_needs(path):
            name, _, number = ver.partition("_")
            v = tuple(int(x) for x in number.split(".") if x.isdigit())
            if name == "GLIBC" and v > (2, glibc_minor):
                problems.append(f"{path}: needs {ver} of {lib}, newer than the tag's glibc")
            if name in MAX_VERSION and v > MAX_VERSION[name]:
                problems.append(f"{path}: needs {ver} of {lib}, newer than GCC 12's")
    assert not problems, "\n".join(problems)
    return len(list(elf_files(libs)))


# --- hiding Debian's libraries --------------------------------------------------

@pytest.fixture(scope="module")
def hidden(tmp_path_factory):
    """A command prefix that runs its command where the dynamic linker cannot
    see Debian's copies of what the wheel bundles (a user and mount
    namespace with a filtered view of the library directory bind-mounted
    over it), or None where this kernel or container allows no such
    namespace."""
    if not shutil.which("unshare"):
        return None
    root = tmp_path_factory.mktemp("hide")
    dirs = sorted({os.path.realpath(d) for d in ("/usr/lib/x86_64-linux-gnu",
                                                 "/lib/x86_64-linux-gnu")
                   if os.path.isdir(d)})
    lines = ["set -e"]
    for i, d in enumerate(dirs):
        orig, view = root / f"orig{i}", root / f"view{i}"
        orig.mkdir()
        view.mkdir()
        for name in os.listdir(d):
            if not HIDE.match(name):
                os.symlink(orig / name, view / name)
        lines += [f"mount --bind {d} {orig}", f"mount --bind {view} {d}"]
    script = root / "hide.sh"
    script.write_text("\n".join(lines + ['exec "$@"', ""]))
    prefix = ["unshare", "-rm", "sh", str(script)]
    return prefix if run(prefix + ["true"]).returncode == 0 else None


CHECK = r'''
import json, os, re, subprocess, sys
import numpy as np
import dmuon

site = sys.argv[1]
pkg = os.path.join(site, "dmuon")
assert os.path.dirname(dmuon.__file__) == pkg, dmuon.__file__
assert dmuon._ext.__file__ == os.path.join(pkg, "_dmuon.so"), dmuon._ext.__file__
assert dmuon.find_dmuond() == os.path.join(pkg, "bin", "dmuond"), dmuon.find_dmuond()


def maps(pid):
    with open(f"/proc/{pid}/maps") as f:
        return sorted({l.split(None, 5)[5].strip() for l in f
                       if len(l.split(None, 5)) == 6 and ".so" in l})


sys.path.insert(0, sys.argv[2])  # the tests folder: smoke.py
from smoke import check_orthogonalize, check_session_step

rng = np.random.default_rng(0)
check_orthogonalize(dmuon, rng)
with dmuon.LocalDaemon(stop_grace=1.0) as d:
    assert d.binary == os.path.join(pkg, "bin", "dmuond"), d.binary
    check_session_step(dmuon, d.address, "wheel", rng)
    ctl = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dmuonctl"),
                          "--server=" + d.address, "health"],
                         capture_output=True, text=True, timeout=60)
    assert ctl.returncode == 0, (ctl.stdout, ctl.stderr)
    daemon = maps(d.pid)
print(json.dumps(dict(python=maps(os.getpid()), dmuond=daemon, health=ctl.stdout.strip())))
'''


def test_clean_venv_without_debian_libraries(wheel, clean_venv, hidden, tmp_path):
    venv, site = clean_venv
    glibc_minor = int(re.search(r"manylinux_2_(\d+)_", wheel.name).group(1))
    bundled = check_elf_files(site, glibc_minor)
    assert bundled > 40, bundled
    prefix = hidden or []
    if hidden:
        control = run(hidden + [ROOT / "bazel-bin" / "daemon" / "dmuond", "--help"])
        assert control.returncode != 0 and "error while loading shared libraries" in \
            control.stderr, ("Debian's libraries are not hidden", control.stderr)
    else:
        warnings.warn("no user and mount namespace here (unshare -rm): the run-time "
                      "checks ran with Debian's libraries visible (the static check and "
                      "the /proc/PID/maps checks still hold)")
    for name in ("dmuond", "dmuonctl"):
        r = ok(run(prefix + [venv / "bin" / name, "--help"], cwd=tmp_path))
        assert r.stdout.startswith(f"{name}: "), r.stdout[:200]
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    r = ok(run(prefix + [venv / "bin" / "python", script, site, HERE], cwd=tmp_path,
               timeout=150))
    info = json.loads(r.stdout.strip().splitlines()[-1])
    inside = (str(site / "dmuon") + os.sep, str(site / "dmuon.libs") + os.sep)
    outside = [p for p in info["dmuond"]
               if not p.startswith(inside) and not BASE_FILE.match(os.path.basename(p))]
    assert not outside, f"dmuond mapped libraries from outside the wheel: {outside}"
    assert any(p.startswith(inside[1]) for p in info["dmuond"]), info["dmuond"]
    debian = [p for p in info["python"] if not p.startswith(str(venv.parent) + os.sep)
              and DEBIAN_COPY.match(os.path.basename(p))]
    assert not debian, f"the interpreter mapped Debian's copies: {debian}"
    assert "SERVING" in info["health"], info["health"]


TRAIN = r'''
import copy, json, os, sys
import torch
import dmuon
from dmuon.optim import DMuon
from helpers import MLP, ReferenceMuon, max_rel_err, mlp_batch, muon_split, train

pkg = os.path.join(sys.argv[1], "dmuon")
assert os.path.dirname(dmuon.__file__) == pkg, dmuon.__file__
torch.manual_seed(0)
ref_model = MLP()
dm_model = copy.deepcopy(ref_model)
hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
             adjust_lr_fn="original")
mats, others = muon_split(ref_model)
ref = ReferenceMuon(mats, others, adamw_lr=3e-3, **hyper)
opt = DMuon(dm_model, adamw_lr=3e-3, **hyper)  # server="auto": a private dmuond
assert opt._handoff.link.daemon.binary == os.path.join(pkg, "bin", "dmuond"), opt._handoff.link.daemon.binary
ref_losses = train(ref_model, ref, 3, mlp_batch)
dm_losses = train(dm_model, opt, 3, mlp_batch)
opt.close()
print(json.dumps(dict(err=max_rel_err(dm_model, ref_model), ref=ref_losses,
                      dm=dm_losses)))
'''


def test_training_with_torch_from_the_wheel(target, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = clean_env(PYTHONPATH=os.pathsep.join([str(target), str(HERE)]))
    r = ok(run([sys.executable, script, target], env=env, cwd=tmp_path, timeout=150))
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["err"] < 1e-5, out
    assert max(abs(a - b) / abs(b) for a, b in zip(out["dm"], out["ref"])) < 1e-5, out


@pytest.mark.parametrize("order,mode", [(("torch", "dmuon", "grpc"), "torch"),
                                        (("dmuon", "grpc", "torch"), "")],
                         ids=["torch-dmuon-grpc-global_torch", "dmuon-grpc-torch"])
def test_symbols_with_the_wheels_extension(target, order, mode, tmp_path):
    info = test_symbols.run_case(order, mode, str(target), tmp_path)
    assert info["extension"] == str(target / "dmuon" / "_dmuon.so"), info
    assert info["dmuond"] == str(target / "dmuon" / "bin" / "dmuond"), info

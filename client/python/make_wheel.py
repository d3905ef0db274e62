"""Builds the dmuon wheel with the Python standard library only.

    /usr/bin/python3 client/python/make_wheel.py --out dist

The wheel holds the dmuon package, the native extension (_dmuon.so) and the
dmuond binary (dmuon/bin/dmuond, what server="auto" starts), all taken from
the Bazel output (build //client/python:_dmuon.so and //server:dmuond
first). The binaries link Debian 12's shared libraries (gRPC, protobuf,
Abseil, OpenBLAS, spdlog): the wheel is for CPython of the interpreter that
builds it on a machine with those packages (./dmuon setup installs them).
"""

import argparse
import base64
import hashlib
import os
import re
import stat
import sys
import sysconfig
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
NAME = "dmuon"


def version():
    with open(os.path.join(HERE, "module.cc")) as f:
        return re.search(r'__version__"\) = "([^"]+)"', f.read()).group(1)


def tag():
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    plat = re.sub(r"[-.]", "_", sysconfig.get_platform())
    return f"{py}-{py}-{plat}"


def record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"{path},sha256={digest.decode()},{len(data)}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "dist"))
    ap.add_argument("--bazel-bin", default=os.path.join(ROOT, "bazel-bin"))
    args = ap.parse_args()
    ver, wheel_tag = version(), tag()
    files = []  # (path in the wheel, bytes, executable)
    pkg = os.path.join(HERE, NAME)
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name), "rb") as f:
                files.append((f"{NAME}/{name}", f.read(), False))
    for src, dst in ((os.path.join(args.bazel_bin, "client", "python", "_dmuon.so"),
                      f"{NAME}/_dmuon.so"),
                     (os.path.join(args.bazel_bin, "server", "dmuond"), f"{NAME}/bin/dmuond")):
        if not os.path.isfile(src):
            sys.exit(f"make_wheel: {src} is missing; build it first "
                     "(bazel build //client/python:_dmuon.so //server:dmuond)")
        with open(src, "rb") as f:
            files.append((dst, f.read(), True))
    with open(os.path.join(HERE, "README.md"), "rb") as f:
        readme = f.read().decode()
    info = f"{NAME}-{ver}.dist-info"
    metadata = "\n".join([
        "Metadata-Version: 2.1",
        f"Name: {NAME}",
        f"Version: {ver}",
        "Summary: Distributed Muon: the dmuond optimizer service, its client, "
        "and dmuon.torch.DMuon (a drop-in for torch.optim.Muon)",
        "License: Apache-2.0",
        "Requires-Python: >=3.9",
        "Requires-Dist: numpy",
        "Provides-Extra: torch",
        "Requires-Dist: torch>=1.13; extra == \"torch\"",
        "Description-Content-Type: text/markdown",
        "",
        readme,
    ])
    wheel = "\n".join(["Wheel-Version: 1.0", "Generator: dmuon make_wheel.py",
                       "Root-Is-Purelib: false", f"Tag: {wheel_tag}", ""])
    files += [(f"{info}/METADATA", metadata.encode(), False),
              (f"{info}/WHEEL", wheel.encode(), False),
              (f"{info}/top_level.txt", f"{NAME}\n".encode(), False)]
    record = [record_line(p, d) for p, d, _ in files] + [f"{info}/RECORD,,"]
    files.append((f"{info}/RECORD", ("\n".join(record) + "\n").encode(), False))
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"{NAME}-{ver}-{wheel_tag}.whl")
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data, executable in files:
            zi = zipfile.ZipInfo(path, date_time=(2024, 1, 1, 0, 0, 0))
            zi.external_attr = ((0o755 if executable else 0o644) | stat.S_IFREG) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
    print(out)


if __name__ == "__main__":
    main()

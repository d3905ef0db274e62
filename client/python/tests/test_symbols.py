"""dmuon, PyPI torch and PyPI grpcio in one process, in every import order.

_dmuon.so links gRPC 1.51, protobuf 3.21 and Abseil as shared libraries
(Debian's in a source checkout, their renamed copies in dmuon.libs/ in the
wheel) and OpenBLAS statically. torch carries its own protobuf (onnx) and
MKL (libtorch_cpu.so exports sgemm_ and 23,000 mkl_* symbols), numpy its own
OpenBLAS (libscipy_openblas64_), grpcio its own gRPC, Abseil, BoringSSL and
upb, Python protobuf its own upb. If the dynamic linker bound one side's
references to the other side's copy, the result would be a crash or, worse,
quietly wrong numbers. (It did: with Debian's shared libopenblas.so.0 and
TORCH_USE_RTLD_GLOBAL=1, the first orthogonalize() crashed in numpy's
OpenBLAS; client/python/BUILD says how the extension avoids it now.)

Each case runs in a fresh interpreter (this file is the worker): the three
imports in the given order, then real work with each: dmuon.orthogonalize
against an SVD oracle, a torch matmul against numpy, a session on a
LocalDaemon through dmuon.Client (one step, checked against the oracle), and
a grpcio health check on the same daemon. It runs under LD_DEBUG=bindings
with LD_BIND_NOW=1, which logs every symbol binding the dynamic linker
makes; the test fails if any reference of dmuon's side (the extension and
every library it brought in) was bound to an object of torch's or grpcio's
side (the project venv's site-packages) or the other way round. The one
exception: libstdc++'s std:: template statics (STB_GNU_UNIQUE), which the
linker unifies process-wide by design. Two more cases load with RTLD_GLOBAL,
where a library's symbols enter the global scope and win every later lookup:
torch's way (TORCH_USE_RTLD_GLOBAL=1) and everything's (sys.setdlopenflags,
as MPI-era code does).

test_wheel.py runs the same worker on the wheel's extension (run_case).
About 6 s a case on 2 cores.
"""

import json
import os
import re
import subprocess
import sys
import sysconfig

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.dirname(HERE)  # client/python: the dmuon package

ORDERS = [
    ("torch", "dmuon", "grpc"),
    ("dmuon", "torch", "grpc"),
    ("grpc", "dmuon", "torch"),
    ("dmuon", "grpc", "torch"),
]
# (order, mode): mode "" plain, "torch" TORCH_USE_RTLD_GLOBAL=1, "all" every
# extension module RTLD_GLOBAL.
CASES = [(o, "") for o in ORDERS] + [(ORDERS[0], "torch"), (ORDERS[1], "all")]

# The base system: objects both sides share legitimately.
BASE = re.compile(r"^(ld-linux-x86-64|linux-vdso|libc|libm|libmvec|libstdc\+\+|libgcc_s|"
                  r"libpthread|libdl|librt|libz)\.so")
# std:: entities (_ZNSt..., _ZZNSt... local statics, typeinfo/vtables of std
# classes, guard variables): libstdc++'s header instantiations, one per
# process by design.
STD = re.compile(r"^_Z(?:Z|GVZ|T[VIS])?N?K?St")
BINDING = re.compile(r"binding file (.*?) \[\d+\] to (.*?) \[\d+\]: \w+ symbol `([^']+)'")


# --- the worker (a fresh interpreter) ---------------------------------------

def worker(order, mode):
    # The daemon this starts must not log its own bindings.
    for k in ("LD_DEBUG", "LD_DEBUG_OUTPUT", "LD_BIND_NOW"):
        os.environ.pop(k, None)
    if mode == "all":
        sys.setdlopenflags(os.RTLD_GLOBAL | os.RTLD_NOW)
    modules = {"torch": ("torch",), "dmuon": ("dmuon",),
               "grpc": ("grpc", "grpc_health.v1.health_pb2_grpc")}
    for name in order:
        for m in modules[name]:
            __import__(m)
    import grpc
    import numpy as np
    import torch
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    import dmuon

    from smoke import check_orthogonalize, check_session_step, rel

    rng = np.random.default_rng(0)
    check_orthogonalize(dmuon, rng)
    a, b = rng.standard_normal((128, 96)), rng.standard_normal((96, 64))
    assert rel((torch.from_numpy(a) @ torch.from_numpy(b)).numpy(), a @ b) < 1e-12
    with dmuon.LocalDaemon(stop_grace=1.0) as d:
        check_session_step(dmuon, d.address, "symbols", rng)
        with grpc.insecure_channel(d.address) as ch:
            grpc.channel_ready_future(ch).result(timeout=10)
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="dmuon.v1.Optimizer"), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING, r
        daemon = d.binary
    print(json.dumps(dict(pid=os.getpid(), dmuon=dmuon.__file__,
                          extension=dmuon._ext.__file__, dmuond=daemon,
                          torch=torch.__file__, grpc=grpc.__file__)))


# --- the parent ---------------------------------------------------------------

def cross_bindings(log, ours_extra=()):
    """The bindings in an LD_DEBUG=bindings log between dmuon's side and the
    project venv's packages (torch, grpcio, protobuf, numpy, nvidia-*), in
    either direction, std:: statics excepted; and the objects of dmuon's side
    that bound anything. An object is dmuon's unless it is in the base
    system, the interpreter or its standard library, or the venv's
    site-packages (where ours_extra names dmuon's own directories, should it
    be installed there)."""
    theirs = {os.path.realpath(p) + os.sep for p in
              {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}}
    ours_extra = tuple(os.path.realpath(p) + os.sep for p in ours_extra)
    stdlib = os.path.realpath(os.path.dirname(os.__file__)) + os.sep  # and lib-dynload
    python = os.path.realpath(sys.executable)
    side = {}

    def side_of(path):
        if path not in side:
            real = os.path.realpath(path) if path else ""
            if (not path or BASE.match(os.path.basename(path)) or real == python
                    or real.startswith(stdlib)):
                side[path] = None
            elif real.startswith(ours_extra):
                side[path] = "dmuon"
            elif any(real.startswith(t) for t in theirs):
                side[path] = "venv"
            else:
                side[path] = "dmuon"
        return side[path]

    bad, seen = set(), set()
    with open(log, errors="replace") as f:
        for line in f:
            if "binding file" not in line:
                continue
            m = BINDING.search(line)
            if not m:
                continue
            ref, to, sym = m.groups()
            a, b = side_of(ref), side_of(to)
            if a == "dmuon":
                seen.add(os.path.realpath(ref))
            if a and b and a != b and not STD.match(sym):
                bad.add(f"{ref} -> {to}: {sym}")
    return sorted(bad), seen


def run_case(order, mode, pythonpath, tmp_path, ours_extra=()):
    """Runs the worker with dmuon from `pythonpath`; returns what it reports
    after checking its exit and the bindings."""
    logs = tmp_path / "ld"
    logs.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "DMUON_DMUOND",
                        "DMUON_EXTENSION_DIR", "TORCH_USE_RTLD_GLOBAL")}
    env.update(PYTHONPATH=pythonpath, LD_DEBUG="bindings", LD_BIND_NOW="1",
               LD_DEBUG_OUTPUT=str(logs / "bindings"))
    if mode == "torch":
        env["TORCH_USE_RTLD_GLOBAL"] = "1"
    r = subprocess.run([sys.executable, os.path.abspath(__file__), ",".join(order), mode],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    try:
        assert r.returncode == 0, (
            f"order {order} mode {mode!r}: exit {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}")
        info = json.loads(r.stdout.strip().splitlines()[-1])
        bad, seen = cross_bindings(logs / f"bindings.{info['pid']}", ours_extra)
        # Not vacuous: the log has the extension's own bindings, on dmuon's side.
        assert os.path.realpath(info["extension"]) in seen, sorted(seen)
        assert not bad, (f"order {order} mode {mode!r}: {len(bad)} symbol bindings cross "
                         "between dmuon's libraries and the venv's:\n" + "\n".join(bad[:40]))
        return info
    finally:
        for f in logs.iterdir():
            f.unlink()  # ~50 MB a case


@pytest.mark.parametrize("order,mode", CASES,
                         ids=["-".join(o) + (f"-global_{m}" if m else "") for o, m in CASES])
def test_no_crash_no_wrong_symbol(order, mode, tmp_path):
    info = run_case(order, mode, PACKAGE_ROOT, tmp_path)
    assert info["dmuon"].startswith(os.path.join(PACKAGE_ROOT, "dmuon") + os.sep)


if __name__ == "__main__":
    worker(sys.argv[1].split(","), sys.argv[2] if len(sys.argv) > 2 else "")

"""A throwaway CA, server and client certificates, made with openssl.

make_tls(dir, server_name) -> the files of the chart's TLS Secret:
ca.crt, tls.crt/tls.key (the server, valid for server_name, localhost and
127.0.0.1) and probe.crt/probe.key (a client certificate for mTLS: what the
TLS profile's exec probe presents). Keys are P-256, valid one day; nothing
outlives the directory.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def _ssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _issue(d: Path, name: str, subject: str, ext: str) -> None:
    """name.key and name.crt signed by ca.key, with the extensions `ext`."""
    _ssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-days", "1", "-out", f"{name}.crt", "-extfile", f"{name}.ext", cwd=d)


def make_tls(d: Path, server_name: str) -> dict[str, bytes]:
    d.mkdir(parents=True, exist_ok=True)
    _ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=dmuon play CA", cwd=d)
    _issue(d, "tls", f"/CN={server_name}",
           f"subjectAltName=DNS:{server_name},DNS:localhost,IP:127.0.0.1\n"
           "extendedKeyUsage=serverAuth\n")
    _issue(d, "probe", "/CN=probe", "extendedKeyUsage=clientAuth\n")
    return {f: (d / f).read_bytes() for f in ("ca.crt", "tls.crt", "tls.key", "probe.crt", "probe.key")}

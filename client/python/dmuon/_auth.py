"""Credentials for a dmuond that requires them (docs/security.md).

Every connection the package makes (``DMuon``, ``dmuon.Client``) takes its
credentials from the environment unless they are passed explicitly
(``dmuon.Client(address, token=..., tls_ca_file=...)``):

- ``DMUON_TOKEN``: the token (dmuond ``--auth-token-file``), sent as
  ``authorization: Bearer <token>``; or ``DMUON_TOKEN_FILE``: a file holding
  it (whitespace trimmed). Not both.
- ``DMUON_TLS_CA_FILE``: PEM CA of dmuond's certificate; set: connect with
  TLS. ``DMUON_TLS_CERT_FILE`` and ``DMUON_TLS_KEY_FILE``: this client's
  certificate and key for mTLS (``--tls-client-ca-file``).
  ``DMUON_TLS_SERVER_NAME``: the name to check dmuond's certificate against
  when it differs from the address' host.

The native client (client_bindings.cc) calls ``from_env`` for every
credential not passed explicitly.
"""

from __future__ import annotations

import os
from typing import Mapping

ENV_VARS = (
    "DMUON_TOKEN",
    "DMUON_TOKEN_FILE",
    "DMUON_TLS_CA_FILE",
    "DMUON_TLS_CERT_FILE",
    "DMUON_TLS_KEY_FILE",
    "DMUON_TLS_SERVER_NAME",
)


def from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The client's credentials from ``environ`` (default: ``os.environ``):
    ``token``, ``tls_ca_file``, ``tls_cert_file``, ``tls_key_file``,
    ``tls_server_name`` ("" when unset). Raises ValueError naming the
    variable when they cannot be used."""
    env = os.environ if environ is None else environ
    token = env.get("DMUON_TOKEN", "")
    token_file = env.get("DMUON_TOKEN_FILE", "")
    if token and token_file:
        raise ValueError("dmuon: set DMUON_TOKEN or DMUON_TOKEN_FILE, not both")
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise ValueError(f"dmuon: DMUON_TOKEN_FILE={token_file}: {e.strerror}") from e
        if not token:
            raise ValueError(f"dmuon: DMUON_TOKEN_FILE={token_file} is empty")
    out = {
        "token": token.strip(),
        "tls_ca_file": env.get("DMUON_TLS_CA_FILE", ""),
        "tls_cert_file": env.get("DMUON_TLS_CERT_FILE", ""),
        "tls_key_file": env.get("DMUON_TLS_KEY_FILE", ""),
        "tls_server_name": env.get("DMUON_TLS_SERVER_NAME", ""),
    }
    if bool(out["tls_cert_file"]) != bool(out["tls_key_file"]):
        raise ValueError("dmuon: DMUON_TLS_CERT_FILE and DMUON_TLS_KEY_FILE go together")
    if out["tls_cert_file"] and not out["tls_ca_file"]:
        raise ValueError("dmuon: DMUON_TLS_CERT_FILE needs DMUON_TLS_CA_FILE "
                         "(the CA of dmuond's certificate)")
    return out

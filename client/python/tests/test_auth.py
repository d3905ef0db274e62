"""Credentials from the environment (dmuon/_auth.py): DMuon and dmuon.Client
reach a dmuond that requires a token (--auth-token-file) through
DMUON_TOKEN / DMUON_TOKEN_FILE, and fail with the daemon's message without
one. TLS itself is tested against the real daemon in tests/daemon_auth_test.cc;
here only the variables' checks."""

import pytest

import dmuon
from dmuon import _auth
from dmuon.optim import DMuon
from helpers import MLP, mlp_batch, train

pytestmark = pytest.mark.timeout(60)


def test_from_env_reads_the_variables(tmp_path):
    assert _auth.from_env({}) == {
        "token": "", "tls_ca_file": "", "tls_cert_file": "", "tls_key_file": "",
        "tls_server_name": ""}
    f = tmp_path / "token"
    f.write_text("  secret\n")
    got = _auth.from_env({"DMUON_TOKEN_FILE": str(f), "DMUON_TLS_CA_FILE": "/ca.pem"})
    assert got["token"] == "secret" and got["tls_ca_file"] == "/ca.pem"


@pytest.mark.parametrize("env, message", [
    ({"DMUON_TOKEN": "a", "DMUON_TOKEN_FILE": "/x"}, "not both"),
    ({"DMUON_TOKEN_FILE": "/nonexistent/token"}, "DMUON_TOKEN_FILE=/nonexistent/token"),
    ({"DMUON_TLS_CERT_FILE": "/c"}, "go together"),
    ({"DMUON_TLS_CERT_FILE": "/c", "DMUON_TLS_KEY_FILE": "/k"}, "needs DMUON_TLS_CA_FILE"),
])
def test_from_env_refuses_what_cannot_work(env, message):
    with pytest.raises(ValueError, match=message):
        _auth.from_env(env)


@pytest.fixture
def token_daemon(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("trainer trainer-token\nreader reader-token\n")
    d = dmuon.LocalDaemon(stop_grace=1.0, flags=[f"--auth-token-file={tokens}"])
    yield d
    d.stop()


def test_dmuon_uses_the_token_from_the_environment(monkeypatch, tmp_path, token_daemon):
    monkeypatch.setenv("DMUON_SERVER", token_daemon.address)
    f = tmp_path / "t"
    f.write_text("trainer-token\n")
    monkeypatch.setenv("DMUON_TOKEN_FILE", str(f))
    model = MLP()
    opt = DMuon(model, lr=0.02)
    train(model, opt, 2, mlp_batch)
    assert opt.state_dict()["dmuon"]["completed_steps"] == 2
    opt.close()


def test_a_missing_or_weak_token_gets_the_daemons_answer(monkeypatch, token_daemon):
    monkeypatch.delenv("DMUON_TOKEN", raising=False)
    monkeypatch.delenv("DMUON_TOKEN_FILE", raising=False)
    params = [("w", 8, 8)]
    c = dmuon.Client(token_daemon.address)
    with pytest.raises(Exception, match="requires a token"):
        c.open_session("j", params)
    monkeypatch.setenv("DMUON_TOKEN", "reader-token")
    c = dmuon.Client(token_daemon.address)
    with pytest.raises(Exception, match="needs role 'trainer'"):
        c.open_session("j", params)
    # An explicit token wins over the environment.
    c = dmuon.Client(token_daemon.address, token="trainer-token")
    s = c.open_session("j", params)
    s.close()


def test_a_token_grpc_cannot_send_is_an_error_not_an_abort(monkeypatch, token_daemon):
    """gRPC aborts the process (SIGABRT) on a header value it cannot send:
    the client refuses such a token first, naming where it came from and
    the byte, never the token."""
    monkeypatch.delenv("DMUON_TOKEN_FILE", raising=False)
    for token, byte in [("tok\u00e9n", "0xc3 at position 3"), ("a\nb", "0x0a at position 1"),
                        ("two words", "0x20 at position 3")]:
        with pytest.raises(ValueError, match=f"token.*has byte {byte}") as e:
            dmuon.Client(token_daemon.address, token=token)
        assert token not in str(e.value)
        monkeypatch.setenv("DMUON_TOKEN", token)
        with pytest.raises(ValueError, match="DMUON_TOKEN"):
            dmuon.Client(token_daemon.address)
        monkeypatch.delenv("DMUON_TOKEN")


def _pki(d):
    """A CA, a server certificate for 127.0.0.1 and a client certificate,
    made with the openssl CLI."""
    import subprocess
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run("req", "-x509", *ec, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem", "-days", "2",
        "-subj", "/CN=test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for name, ext in [("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
                      ("client", "subjectAltName=URI:spiffe://test/py\nextendedKeyUsage=clientAuth\n")]:
        with open(f"{d}/{name}.ext", "w") as f:
            f.write("basicConstraints=CA:FALSE\n" + ext)
        run("req", *ec, "-keyout", f"{d}/{name}.key", "-out", f"{d}/{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{d}/{name}.csr", "-CA", f"{d}/ca.pem", "-CAkey", f"{d}/ca.key",
            "-CAcreateserial", "-days", "2", "-out", f"{d}/{name}.pem", "-extfile", f"{d}/{name}.ext")


def test_tls_and_client_certificates_from_the_environment(monkeypatch, tmp_path):
    _pki(tmp_path)
    d = dmuon.LocalDaemon(stop_grace=1.0, flags=[
        f"--tls-cert-file={tmp_path}/server.pem", f"--tls-key-file={tmp_path}/server.key",
        f"--tls-client-ca-file={tmp_path}/ca.pem"])
    try:
        for var in _auth.ENV_VARS:
            monkeypatch.delenv(var, raising=False)
        params = [("w", 8, 8)]
        # Plaintext, and TLS without a client certificate: refused.
        with pytest.raises(Exception):
            dmuon.Client(d.address, deadline=2.0).open_session("j", params)
        monkeypatch.setenv("DMUON_TLS_CA_FILE", f"{tmp_path}/ca.pem")
        with pytest.raises(Exception):
            dmuon.Client(d.address, deadline=2.0).open_session("j", params)
        monkeypatch.setenv("DMUON_TLS_CERT_FILE", f"{tmp_path}/client.pem")
        monkeypatch.setenv("DMUON_TLS_KEY_FILE", f"{tmp_path}/client.key")
        s = dmuon.Client(d.address).open_session("j", params)
        s.close()
    finally:
        d.stop()

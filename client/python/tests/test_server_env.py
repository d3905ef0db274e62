"""server="auto" reads $DMUON_SERVER: one address, a comma list (a pool),
or a DNS name with several addresses (a pool of one daemon per address)."""

import socket

import pytest
import torch

import dmuon
from dmuon import _session
from dmuon.optim import DMuon
from helpers import MLP, mlp_batch, train

pytestmark = pytest.mark.timeout(60)


def test_single_address_uses_that_daemon(monkeypatch, daemon):
    monkeypatch.setenv("DMUON_SERVER", daemon.address)
    model = MLP()
    opt = DMuon(model, lr=0.02)
    assert opt.address == daemon.address and opt._handoff.link.daemon is None  # no private one
    train(model, opt, 2, mlp_batch)
    assert opt.state_dict()["dmuon"]["completed_steps"] == 2
    opt.close()
    assert daemon.alive()


def test_comma_list_is_a_pool(monkeypatch, daemon):
    with dmuon.LocalDaemon(stop_grace=1.0) as other:
        monkeypatch.setenv("DMUON_SERVER", f"{daemon.address}, {other.address}")
        model = MLP()
        opt = DMuon(model, lr=0.02)
        assert opt.address == [daemon.address, other.address]
        assert sorted(set(opt.pool_owner)) == [0, 1]  # 3 matrices over 2 daemons
        train(model, opt, 2, mlp_batch)
        opt.close()


def _free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def test_dns_name_with_several_addresses_is_a_pool(monkeypatch):
    """Two daemons on one port of two loopback addresses, behind one name (a
    headless Kubernetes service resolves so)."""
    port = _free_port("127.0.0.2")
    a = dmuon.LocalDaemon(flags=[f"--listen=127.0.0.2:{port}"], stop_grace=1.0)
    b = dmuon.LocalDaemon(flags=[f"--listen=127.0.0.3:{port}"], stop_grace=1.0)
    real = socket.getaddrinfo

    def resolve(host, *args, **kw):
        if host == "dmuond.pool.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
                    for ip in ("127.0.0.3", "127.0.0.2", "127.0.0.3")]
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    try:
        monkeypatch.setenv("DMUON_SERVER", f"dmuond.pool.test:{port}")
        model = MLP()
        opt = DMuon(model, lr=0.02)
        assert opt.address == [f"127.0.0.2:{port}", f"127.0.0.3:{port}"]
        assert sorted(set(opt.pool_owner)) == [0, 1]
        train(model, opt, 2, mlp_batch)
        opt.close()
    finally:
        a.stop()
        b.stop()


def test_names_with_one_address_per_family_stay_one_daemon():
    assert _session.server_from_env("localhost:5") == "localhost:5"
    assert _session.server_from_env("10.0.0.1:5") == "10.0.0.1:5"
    assert _session.server_from_env("unix:/run/dmuond.sock") == "unix:/run/dmuond.sock"
    with pytest.raises(ValueError, match="DMUON_SERVER"):
        _session.server_from_env(" , ")


def test_cuda_parameters_with_a_cpu_daemon_warn_once(monkeypatch, capsys):
    monkeypatch.setattr(_session, "_warned_cuda", False)
    with pytest.warns(RuntimeWarning, match="no GPU dmuond is reachable"):
        _session.warn_cuda_staged(torch.device("cuda", 0), "staged", "127.0.0.1:1")
    err = capsys.readouterr().err
    assert "DMUON_SERVER" in err
    # The wheel has no dmuond_cuda: the banner says where one comes from.
    assert "the wheel ships the CPU dmuond only" in err and "--config=cuda" in err
    _session.warn_cuda_staged(torch.device("cuda", 0), "staged", "127.0.0.1:1")  # silent
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("value, why", [
    ("127.0.0.1", "no port"),
    ("localhost", "no port"),
    ("http://127.0.0.1:50051", "a URL"),
    ("127.0.0.1:50051,10.0.0.2", "no port"),
])
def test_an_address_without_a_port_is_refused_naming_the_variable(monkeypatch, value, why):
    """Not an address: refused when read, naming $DMUON_SERVER (gRPC would
    try port 443 for 60 s in silence)."""
    with pytest.raises(ValueError, match=rf"\$DMUON_SERVER=.*{why}"):
        _session.server_from_env(value)
    monkeypatch.setenv("DMUON_SERVER", value)
    with pytest.raises(ValueError, match=r"\$DMUON_SERVER"):
        DMuon(MLP(), lr=0.02)


def _refused_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_a_refused_address_fails_in_seconds_naming_the_variable(monkeypatch):
    """No dmuond at $DMUON_SERVER: UNAVAILABLE after connect_timeout (not the
    60 s call timeout), naming the variable and what to do."""
    import time

    address = f"127.0.0.1:{_refused_port()}"
    monkeypatch.setenv("DMUON_SERVER", address)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError) as e:
        DMuon(MLP(), lr=0.02, daemon_options=dmuon.DaemonOptions(connect_timeout=1.0))
    assert time.monotonic() - t0 < 30
    msg = str(e.value)
    assert f"$DMUON_SERVER='{address}'" in msg and "waited 1 s" in msg, msg
    assert "connect_timeout" in msg and "unset it" in msg, msg
    # Passed explicitly: the same wait, the address named.
    with pytest.raises(ConnectionError, match=address):
        DMuon(MLP(), lr=0.02, daemon_options=dmuon.DaemonOptions(
            server=address, connect_timeout=1.0))

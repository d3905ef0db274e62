"""The private dmuond of server="auto", with real processes: Ctrl-C reaches
the trainer only, a SIGKILLed trainer's work directory is cleaned up by the
next start, and a dead private daemon's error says what happened and what
to do."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import dmuon
from dmuon.optim import DMuon
from helpers import MLP, loss_of, mlp_batch

pytestmark = pytest.mark.timeout(60)
PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAINER = """
import os, signal, sys, time, torch
# Python's Ctrl-C handler, as in a terminal, even when this test runs in a
# background job (which starts its children with SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, %r)
from dmuon.optim import DMuon
model = torch.nn.Linear(8, 8, bias=False)
opt = DMuon(model, lr=0.02)
d = opt._handoff.link.daemon
print(d.pid, os.getpgid(d.pid), os.getsid(d.pid), d.workdir, flush=True)
try:
    for step in range(100000):
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 2:
            print("ready", flush=True)
        time.sleep(0.005)
except KeyboardInterrupt:
    sd = opt.state_dict()  # a checkpoint on Ctrl-C, Muon momentum included
    print("saved", sorted(n for n in sd["state"][0]), d.alive(), flush=True)
    opt.close()
""" % PKG


def _trainer():
    # Its own session and process group, as a shell job would be, so that
    # SIGINT to that group is what Ctrl-C sends and pytest is not in it.
    p = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    pid, pgid, sid, workdir = p.stdout.readline().split()
    return p, int(pid), int(pgid), int(sid), workdir


def _gone(pid, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dmuon._daemon._start_time(pid) is None:
            return True
        time.sleep(0.05)
    return False


def test_ctrl_c_reaches_the_trainer_not_its_daemon():
    p, pid, pgid, sid, workdir = _trainer()
    try:
        assert pgid != os.getpgid(p.pid) and sid == pid  # a session of its own
        assert p.stdout.readline().strip() == "ready"
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C: the foreground process group
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert out.strip() == "saved ['momentum_buffer', 'step'] True", err
    assert _gone(pid) and not os.path.exists(workdir)  # close() stopped it


def test_sigkilled_trainers_workdir_is_removed_at_the_next_start(daemon):
    p, pid, _, _, workdir = _trainer()
    assert p.stdout.readline().strip() == "ready"
    p.kill()
    p.wait()
    assert _gone(pid)  # PR_SET_PDEATHSIG: SIGTERM when its trainer dies
    assert os.path.isdir(workdir)  # no finalizer ran
    live = daemon.workdir
    with dmuon.LocalDaemon(stop_grace=1.0) as d:
        assert not os.path.exists(workdir)
        assert os.path.isdir(live) and os.path.isdir(d.workdir)  # running: kept


def test_dead_private_daemon_is_named_with_its_signal_log_and_remedy():
    model = MLP()
    opt = DMuon(model, lr=0.02, timeout=5.0)
    loss_of(model, mlp_batch(0)).backward()
    opt.step()
    opt.zero_grad()
    d = opt._handoff.link.daemon
    os.kill(d.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(dmuon.UnavailableError) as e:
        loss_of(model, mlp_batch(1)).backward()
        opt.step()
    assert time.monotonic() - t0 < 5.0 + 2.0
    msg = str(e.value)
    assert f"private dmuond (pid {d.pid}" in msg and "signal SIGKILL" in msg
    assert d.log_path in msg and "load_state_dict" in msg
    assert msg.count("private dmuond (pid") == 1  # explained once
    assert isinstance(e.value.__cause__, dmuon.Error) and e.value.code == "UNAVAILABLE"
    # The checkpoint: state_dict() names the daemon and offers the local half.
    opt.zero_grad()
    with pytest.raises(dmuon.Error) as e:
        opt.state_dict()
    assert "local_state_dict()" in str(e.value) and "signal SIGKILL" in str(e.value)
    local = opt.local_state_dict()
    assert "dmuon" not in local and len(local["param_groups"]) == len(opt.param_groups)
    opt.close()

"""state_dict / load_state_dict, including the momentum dmuond holds."""

import copy
import gc
import io
import os
import subprocess
import sys
import time

import pytest
import torch

import dmuon
from dmuon.optim import DMuon
from helpers import TinyLM, lm_batch, train

HYPER = dict(lr=0.02, weight_decay=0.05, adamw_lr=3e-3)


def test_round_trip_onto_new_optimizer_and_new_daemon_is_bit_exact():
    torch.manual_seed(3)
    model = TinyLM()
    resumed_model = copy.deepcopy(model)

    # Uninterrupted: 12 steps on one private daemon.
    opt = DMuon(model, adamw=[model.head], **HYPER)
    train(model, opt, 12, lm_batch)
    opt.close()

    # Interrupted after 6 steps: checkpoint through torch.save, everything
    # (optimizer, private daemon) thrown away, then resumed on a new daemon.
    opt = DMuon(resumed_model, adamw=[resumed_model.head], **HYPER)
    first_daemon = opt._daemon.address
    train(resumed_model, opt, 6, lm_batch)
    buf = io.BytesIO()
    torch.save({"model": resumed_model.state_dict(), "opt": opt.state_dict()}, buf)
    opt.close()
    del opt
    buf.seek(0)
    ckpt = torch.load(buf)
    fresh = TinyLM()
    fresh.load_state_dict(ckpt["model"])
    opt = DMuon(fresh, adamw=[fresh.head], **HYPER)
    assert opt._daemon.address != first_daemon
    opt.load_state_dict(ckpt["opt"])
    assert opt.session.step == 7
    train(fresh, opt, 6, lm_batch, start=6)
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
    assert ckpt["opt"]["dmuon"]["completed_steps"] == 6
    assert set(ckpt["opt"]["dmuon"]["momentum"]) == {
        r["name"] for r in opt.routing if r["route"] == "muon"}
    opt.close()


def test_state_dict_names_and_shapes(daemon):
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 4 * 4, 3))
    opt = DMuon(model, server=daemon.address)
    model(torch.randn(2, 2, 6, 6)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert {k: tuple(v.shape) for k, v in sd["dmuon"]["momentum"].items()} == {
        "0.weight": (4, 18), "2.weight": (3, 64)}
    assert sd["dmuon"]["momentum"]["0.weight"].abs().sum() > 0
    opt.close()


def test_load_rejects_a_mismatched_checkpoint(daemon):
    a = DMuon(torch.nn.Linear(4, 6, bias=False), server=daemon.address)
    sd = a.state_dict()
    sd["dmuon"]["momentum"]["weight"] = torch.zeros(6, 5)
    b = DMuon(torch.nn.Linear(4, 6, bias=False), server=daemon.address)
    with pytest.raises(ValueError, match=r"momentum of 'weight' is \[6, 5\]"):
        b.load_state_dict(sd)
    del sd["dmuon"]["momentum"]["weight"]
    with pytest.raises(ValueError, match="no momentum for 'weight'"):
        b.load_state_dict(sd)
    a.close()
    b.close()


def test_state_dict_mid_step_is_refused(daemon):
    model = torch.nn.Linear(4, 6, bias=False)
    opt = DMuon(model, server=daemon.address)
    model(torch.randn(3, 4)).sum().backward()  # the hook hands the gradient off
    with pytest.raises(RuntimeError, match="middle of a step"):
        opt.state_dict()
    opt.step()
    assert opt.state_dict()["dmuon"]["completed_steps"] == 1
    opt.close()


def test_lr_scheduler_changes_lr_for_both_halves(daemon):
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    opt = DMuon(model, lr=0.1, adamw_lr=0.01, server=daemon.address)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    assert sorted(g["lr"] for g in opt.param_groups) == [0.005, 0.05]
    opt.close()


def test_client_session_api(daemon):
    client = dmuon.Client(daemon.address, deadline=5.0)
    s = client.open_session("raw-api", [("w", 3, 5), dict(name="v", rows=6, cols=2)],
                            groups=[dict(momentum=0.9, nesterov=False)])
    assert len(s) == 2 and s.names == ["w", "v"] and s.step == 1
    g = s.gradient(0)
    assert g.shape == (3, 5) and g.flags.writeable
    g[:] = 1.0
    assert s.gradient(0)[1, 2] == 1.0  # a view: zero-copy
    s.gradient(1)[:] = 2.0
    s.gradients_ready([0, 1])
    s.wait_update(0)
    s.wait_update(1)
    assert s.try_update(0) and not s.skipped(0)
    u = s.update(0)
    assert not u.flags.writeable
    # momentum 0.9, no Nesterov: U = 0.1 * G; NS of a rank-1 matrix.
    expected = dmuon.orthogonalize((0.1 * g).astype("float32"), method="direct")
    assert abs(u - expected).max() < 1e-5
    s.finish_step()
    st = s.get_state()
    assert st["completed_steps"] == 1 and st["names"] == ["w", "v"]
    assert abs(st["momentum"][0] - 0.1).max() < 1e-7
    s.close()


def test_private_daemon_stops_with_the_optimizer():
    opt = DMuon(torch.nn.Linear(4, 4))
    daemon = opt._daemon
    assert daemon.alive()
    del opt
    gc.collect()
    assert not daemon.alive()


def test_private_daemon_stops_at_exit_without_close():
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys; sys.path.insert(0, %r); import torch; from dmuon.optim import "
            "DMuon; opt = DMuon(torch.nn.Linear(4, 4)); print(opt._daemon.pid)"
            % os.path.dirname(here))
    pid = int(subprocess.check_output([sys.executable, "-c", code], timeout=60))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail(f"dmuond {pid} still runs after its trainer exited")


def test_adamw_only_model_needs_no_daemon():
    model = torch.nn.LayerNorm(8)
    opt = DMuon(model, adamw_lr=0.1)
    assert opt.session is None and opt._daemon is None
    model(torch.randn(2, 8)).sum().backward()
    before = model.bias.detach().clone()
    opt.step()
    assert not torch.equal(model.bias, before)
    assert "0 of 2 parameters" in opt.routing_table

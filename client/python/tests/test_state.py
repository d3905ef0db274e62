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
from helpers import TinyLM, lm_batch, momentum_by_name, state_key, train

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
    first_daemon = opt._handoff.link.daemon.address
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
    assert opt._handoff.link.daemon.address != first_daemon
    opt.load_state_dict(ckpt["opt"])
    assert opt.session.step == 7
    train(fresh, opt, 6, lm_batch, start=6)
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
    # torch.optim.Muon's layout: a momentum_buffer and step per Muon parameter
    assert ckpt["opt"]["dmuon"] == {"format": 2, "completed_steps": 6}
    muon = [k for g in ckpt["opt"]["param_groups"] if g["use_muon"] for k in g["params"]]
    assert len(muon) == sum(r["route"] == "muon" for r in opt.routing)
    assert {k for k, v in ckpt["opt"]["state"].items() if "momentum_buffer" in v} == set(muon)
    assert all(float(ckpt["opt"]["state"][k]["step"]) == 6.0 for k in muon)
    opt.close()


def test_state_dict_names_and_shapes(daemon):
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 4 * 4, 3))
    opt = DMuon(model, server=daemon.address)
    model(torch.randn(2, 2, 6, 6)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    # the parameter's shape (a conv weight too), fp32, as torch.optim.Muon keeps it
    mb = momentum_by_name(model, opt, sd)
    assert {k: tuple(v.shape) for k, v in mb.items()} == {
        "0.weight": (4, 2, 3, 3), "2.weight": (3, 64)}
    assert all(v.dtype == torch.float32 for v in mb.values())
    assert mb["0.weight"].abs().sum() > 0
    st = opt.session.get_state()
    assert torch.equal(mb["2.weight"], torch.from_numpy(st["momentum"][1]))
    assert float(sd["state"][state_key(opt, sd, model[0].weight)]["step"]) == 1.0
    opt.close()


def test_opt_state_lists_momentum_buffer_and_step_without_fetching(daemon):
    """opt.state[p] of a Muon parameter lists "momentum_buffer" and "step"
    (as torch's flatten_optimizer_state_dict load reads them) and reads
    dmuond only when a value is read; dict(), copy and pickle give them."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    opt = DMuon(model, server=daemon.address)
    w = model[0].weight
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    st = opt.state[w]
    assert list(st) == ["momentum_buffer", "step"] and len(st) == 2 and st
    assert "step" in st and "momentum_buffer" in st.keys() and "exp_avg" not in st
    assert opt._muon_state.cache is None  # nothing read yet
    assert "read from dmuond" in repr(st) and opt._muon_state.cache is None
    assert opt.local_state_dict()["state"].keys() == {2, 3}  # AdamW's (biases)
    assert opt._muon_state.cache is None
    m = st["momentum_buffer"]
    assert m.shape == w.shape and m.abs().sum() > 0
    assert float(st["step"]) == 1.0
    plain = dict(st)
    assert plain.keys() == {"momentum_buffer", "step"} and torch.equal(plain["momentum_buffer"], m)
    for other in (copy.copy(st), copy.deepcopy(st),
                  torch.load(io.BytesIO(_saved(st)), weights_only=False)):
        assert type(other) is dict and torch.equal(other["momentum_buffer"], m), type(other)
        assert float(other["step"]) == 1.0
    assert torch.equal(dict(st.items())["momentum_buffer"], m)
    assert [float(v) if v.dim() == 0 else v.shape for v in st.values()] == [w.shape, 1.0]
    saved = torch.load(io.BytesIO(_saved(opt.state)), weights_only=False)
    firsts = [v for v in saved.values() if v.keys() == {"momentum_buffer", "step"}]
    assert len(firsts) == 2 and torch.equal(firsts[0]["momentum_buffer"], m)
    opt.close()


def _saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_loads_a_format_1_checkpoint(daemon):
    """A checkpoint of the layout before format 2 ("dmuon": {"format": 1,
    "completed_steps", "momentum": {table name: fp32 matrix}}, Muon
    parameters without state) loads, and training goes on as from the
    format-2 dict of the same state."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 4 * 4, 3))
    start = copy.deepcopy(model)
    opt = DMuon(model, server=daemon.address, **HYPER)
    for s in range(2):
        model(torch.randn(2, 2, 6, 6, generator=torch.Generator().manual_seed(s))
              ).square().sum().backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    st = opt.session.get_state()
    old = copy.deepcopy(opt.local_state_dict())
    old["dmuon"] = {"format": 1, "completed_steps": int(st["completed_steps"]),
                    "momentum": {n: torch.from_numpy(m).clone()
                                 for n, m in zip(st["names"], st["momentum"])}}
    assert set(old["dmuon"]["momentum"]) == {"0.weight", "2.weight"}
    for kind, ckpt in (("format 1", old), ("format 2", sd)):
        fresh = copy.deepcopy(start)
        opt2 = DMuon(fresh, server=daemon.address, **HYPER)
        opt2.load_state_dict(ckpt)
        assert opt2.session.step == 3, kind
        got = opt2.state_dict()
        assert got["dmuon"] == {"format": 2, "completed_steps": 2}, kind
        for k, v in sd["state"].items():
            for n, t in v.items():
                assert torch.equal(got["state"][k][n], t), (kind, k, n)
        opt2.close()
    bad = copy.deepcopy(old)
    del bad["dmuon"]["momentum"]["2.weight"]
    opt2 = DMuon(copy.deepcopy(start), server=daemon.address, **HYPER)
    with pytest.raises(ValueError, match="no momentum for '2.weight'"):
        opt2.load_state_dict(bad)
    opt2.close()
    opt.close()


def test_load_rejects_a_mismatched_checkpoint(daemon):
    a = DMuon(torch.nn.Linear(4, 6, bias=False), server=daemon.address)
    sd = a.state_dict()
    sd["state"][0]["momentum_buffer"] = torch.zeros(6, 5)
    b = DMuon(torch.nn.Linear(4, 6, bias=False), server=daemon.address)
    with pytest.raises(ValueError, match=r"momentum_buffer of 'weight' is \[6, 5\]; "
                                         r"the parameter is \[6, 4\]"):
        b.load_state_dict(sd)
    del sd["state"][0]["momentum_buffer"]
    with pytest.raises(ValueError, match=r"no momentum for 'weight'.*state\[0\]"):
        b.load_state_dict(sd)
    sd["dmuon"]["format"] = 3
    with pytest.raises(ValueError, match=r"unknown 'dmuon' format 3.*formats 1 and 2"):
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
    daemon = opt._handoff.link.daemon
    assert daemon.alive()
    del opt
    gc.collect()
    assert not daemon.alive()


def test_private_daemon_stops_at_exit_without_close():
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys; sys.path.insert(0, %r); import torch; from dmuon.optim import "
            "DMuon; opt = DMuon(torch.nn.Linear(4, 4)); print(opt._handoff.link.daemon.pid)"
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
    assert opt.session is None and opt._handoff.link.daemon is None
    model(torch.randn(2, 8)).sum().backward()
    before = model.bias.detach().clone()
    opt.step()
    assert not torch.equal(model.bias, before)
    assert "0 of 2 parameters" in opt.routing_table


def test_session_hand_off_copies_declares_and_refuses_before_writing(daemon):
    """Session.hand_off, DMuon's hand-off of a CPU float32 gradient: one
    call copies it into the session's memory and declares it, with or
    without this step's momentum. A buffer of the wrong size, format or
    layout is refused naming the parameter, with nothing written or
    declared: the step then completes from the right gradients, each update
    as gradients_ready gives it (a second session fed the same gradients by
    gradient() and gradients_ready, compared bit for bit)."""
    import numpy as np

    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    client = dmuon.Client(daemon.address, deadline=5.0)
    spec = [("w", 6, 4), ("v", 3, 5)]
    groups = [dict(momentum=0.9, nesterov=True)]
    one = client.open_session(f"hand-off-{os.getpid()}", spec, groups=groups)
    two = client.open_session(f"gradient-{os.getpid()}", spec, groups=groups)
    for step in range(2):
        gw = rng.standard_normal((6, 4), dtype=np.float32)
        gv = rng.standard_normal((3, 5), dtype=np.float32)
        with pytest.raises(ValueError, match="w's gradient has 23 elements"):
            one.hand_off(0, gw.ravel()[:-1])
        with pytest.raises(ValueError, match="w's gradient is of format 'd'"):
            one.hand_off(0, gw.astype(np.float64))
        with pytest.raises(ValueError, match="v's gradient is not C-contiguous"):
            one.hand_off(1, np.asfortranarray(gv))
        handed = [False, False]
        one.gradient(0)[:] = np.nan  # what a refused call must leave as it is
        one.gradient(1)[:] = np.nan
        sentinel = [one.gradient(i).tobytes() for i in range(2)]
        with pytest.raises(IndexError):
            one.hand_off(2, gv)
        with pytest.raises(IndexError, match="handed"):
            one.hand_off(1, gv, None, handed[:1])
        with pytest.raises(ValueError, match="w's gradient has 23 elements"):
            one.hand_off(0, gw.ravel()[:-1], None, handed)
        assert handed == [False, False]  # refused: not marked, nothing written
        assert [one.gradient(i).tobytes() for i in range(2)] == sentinel
        assert one.hand_off(0, gw, None, handed) > 0  # when the copy was done (ns)
        assert handed == [True, False]
        one.hand_off(1, gv, 0.8)  # this step's momentum, as gradients_ready's
        two.gradient(0)[:] = gw
        two.gradient(1)[:] = gv
        two.gradients_ready([0])
        two.gradients_ready([1], momentum=[0.8])
        for s in (one, two):
            s.wait_update(0), s.wait_update(1)
        for i in range(2):
            assert one.update(i).tobytes() == two.update(i).tobytes()
        one.finish_step(), two.finish_step()
    one.close(), two.close()

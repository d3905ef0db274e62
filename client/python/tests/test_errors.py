"""The errors a user meets, each with a message that says what to do."""

import os
import signal
import time

import pytest
import torch

import dmuon
from dmuon.optim import DMuon
from helpers import MLP, TinyLM, lm_batch, loss_of, mlp_batch, train


def test_daemon_not_reachable():
    t0 = time.monotonic()
    with pytest.raises(dmuon.UnavailableError) as e:
        DMuon(MLP(), server="127.0.0.1:1", timeout=1.0)
    assert "127.0.0.1:1" in str(e.value) and "not reachable" in str(e.value)
    assert isinstance(e.value, ConnectionError) and e.value.code == "UNAVAILABLE"
    assert time.monotonic() - t0 < 5


def test_daemon_killed_mid_training(fresh_daemon):
    model = TinyLM()
    opt = DMuon(model, server=fresh_daemon.address, adamw=[model.head], timeout=5.0)
    train(model, opt, 2, lm_batch)
    os.kill(fresh_daemon.pid, signal.SIGKILL)
    fresh_daemon.process.wait()
    t0 = time.monotonic()
    with pytest.raises(dmuon.Error) as e:
        loss_of(model, lm_batch(2)).backward()
        opt.step()
    assert time.monotonic() - t0 < 5.0 + 1.0
    assert fresh_daemon.address in str(e.value)
    # Not a bare "Socket closed": what happened, and how to continue the job.
    msg = str(e.value)
    assert isinstance(e.value, dmuon.UnavailableError), msg
    assert "lost mid-training" in msg and "this step was not taken" in msg, msg
    assert f"job_id='{opt.job_id}', resume=N), N your last checkpoint's step" in msg, msg
    opt.close()


def test_daemon_killed_while_computing(fresh_daemon):
    """Killed after the gradients were handed off: step() raises, naming it."""
    model = MLP()
    opt = DMuon(model, server=fresh_daemon.address, timeout=3.0)
    os.kill(fresh_daemon.pid, signal.SIGSTOP)  # frozen: nothing comes back
    loss_of(model, mlp_batch(0)).backward()  # handed off during backward
    os.kill(fresh_daemon.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(dmuon.Error, match=fresh_daemon.address.replace(".", r"\.")):
        opt.step()
    assert time.monotonic() - t0 < 3.0 + 1.0
    opt.close()


def test_daemon_hung_hits_the_deadline(fresh_daemon):
    model = MLP()
    opt = DMuon(model, server=fresh_daemon.address, timeout=1.0)
    os.kill(fresh_daemon.pid, signal.SIGSTOP)
    try:
        loss_of(model, mlp_batch(0)).backward()
        t0 = time.monotonic()
        with pytest.raises(dmuon.DeadlineExceededError,
                           match="not back from dmuond at " +
                                 fresh_daemon.address.replace(".", r"\.")) as e:
            opt.step()
        assert 0.9 < time.monotonic() - t0 < 3.0
        assert isinstance(e.value, TimeoutError)
    finally:
        os.kill(fresh_daemon.pid, signal.SIGKILL)
    opt.close()


def test_parameter_that_changed_shape(daemon):
    model = MLP()
    opt = DMuon(model, server=daemon.address)
    train(model, opt, 1, mlp_batch)
    with torch.no_grad():
        model.fc2.weight.data = torch.randn(40, 48)
        model.fc2.bias.data = torch.randn(40)
        model.fc3.weight.data = torch.randn(10, 40)
    with pytest.raises(ValueError, match=r"fc2.weight now has shape \[40, 48\]; it was "
                                         r"registered with dmuond as \[48, 48\]"):
        loss_of(model, mlp_batch(1)).backward()
        opt.step()
    opt.close()


def test_parameter_that_changed_shape_without_model(daemon):
    """Without the model there is no forward hook: step() finds it."""
    model = MLP()
    opt = DMuon(model.parameters(), server=daemon.address, overlap=False)
    train(model, opt, 1, mlp_batch)
    opt.zero_grad(set_to_none=True)
    model.fc3.weight.data = torch.randn(10, 40)
    model.fc2.weight.data = torch.randn(40, 48)
    model.fc2.bias.data = torch.randn(40)
    loss_of(model, mlp_batch(1)).backward()
    with pytest.raises(ValueError, match=r"params\[0\]\[2\] now has shape \[40, 48\]"):
        opt.step()
    opt.close()


def test_changing_a_fixed_hyperparameter(daemon):
    """nesterov, ns_* and eps are fixed in dmuond (momentum is not: it goes
    with each step's hand-offs, test_param_groups.py)."""
    model = MLP()
    opt = DMuon(model, server=daemon.address)
    opt.param_groups[0]["nesterov"] = False
    loss_of(model, mlp_batch(0)).backward()
    with pytest.raises(ValueError, match=r"\['nesterov'\] changed from True to False"):
        opt.step()
    opt.close()


def test_bad_hyperparameters_are_refused_up_front(daemon):
    with pytest.raises(ValueError, match="not supported"):
        DMuon(MLP(), server=daemon.address, adjust_lr_fn="bogus")
    with pytest.raises(dmuon.InvalidArgumentError, match="method"):
        DMuon(MLP(), server=daemon.address, method="bogus")
    with pytest.raises(dmuon.InvalidArgumentError):
        DMuon(MLP(), server=daemon.address, ns_coefficients="bogus")


def test_non_finite_gradient_is_skipped_with_a_warning(daemon):
    model = torch.nn.Linear(4, 4, bias=False)
    opt = DMuon(model, server=daemon.address)
    before = model.weight.detach().clone()
    model.weight.grad = torch.full((4, 4), float("nan"))
    with pytest.warns(RuntimeWarning, match="skipped weight"):
        opt.step()
    assert torch.equal(model.weight, before)
    opt.close()


def test_step_after_close():
    model = MLP()
    opt = DMuon(model)
    opt.close()
    with pytest.raises(RuntimeError, match="after close"):
        opt.step()

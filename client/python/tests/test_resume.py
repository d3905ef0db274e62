"""DMuon(resume=...) against a real dmuond (docs/protocol.md "Resume"): the
default starts fresh and refuses a job_id that holds momentum, naming the job,
its step and both ways on; resume=True continues it, "replace" starts it
over, "auto" is the 1.0 behaviour; each continued or replaced run matches an
uninterrupted one bit for bit. Client.open_session(resume=) is the same on
the low-level API. A daemon restarted on its --state-dir: resume=True
continues the job from its snapshot."""

import copy

import numpy
import pytest
import torch
from torch import nn

import dmuon
from dmuon import DaemonOptions
from dmuon.optim import DMuon
from helpers import mlp_batch, train

HYPER = dict(lr=0.02, weight_decay=0.05)


def _model():
    # Every parameter a Muon matrix: nothing lives in the local AdamW, so a
    # run split over two DMuons equals one DMuon's run exactly.
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(24, 48, bias=False), nn.Tanh(),
                         nn.Linear(48, 10, bias=False))


def _straight(address, job_id, steps):
    model = _model()
    opt = DMuon(model, server=address, job_id=job_id, **HYPER)
    train(model, opt, steps, mlp_batch)
    opt.close()
    return model


def _equal(a, b):
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name


def test_default_is_fresh_and_refuses_a_job_with_momentum(daemon):
    model = _model()
    opt = DMuon(model, server=daemon.address, job_id="py-resume-fresh", **HYPER)
    assert opt.session.step == 1
    train(model, opt, 2, mlp_batch)
    opt.close()
    with pytest.raises(dmuon.Error) as e:
        DMuon(_model(), server=daemon.address, job_id="py-resume-fresh", **HYPER)
    assert e.value.code == "ALREADY_EXISTS"
    for part in ("job 'py-resume-fresh'", "completed step 2", "resume=True",
                 'resume="replace"'):
        assert part in str(e.value), part
    # resume=False is the same as the default.
    with pytest.raises(dmuon.Error, match="completed step 2"):
        DMuon(_model(), server=daemon.address, job_id="py-resume-fresh",
              resume=False, **HYPER)


@pytest.mark.parametrize("resume", [True, "continue", "auto"])
def test_resume_true_continues_bit_for_bit(daemon, resume):
    job = f"py-resume-continue-{resume}"
    want = _straight(daemon.address, f"{job}-straight", 4)
    model = _model()
    opt = DMuon(model, server=daemon.address, job_id=job, **HYPER)
    train(model, opt, 2, mlp_batch)
    opt.close()
    again = copy.deepcopy(model)
    opt = DMuon(again, server=daemon.address, job_id=job, resume=resume, **HYPER)
    assert opt.session.step == 3
    train(again, opt, 2, mlp_batch, start=2)
    opt.close()
    _equal(want, again)


def test_replace_starts_over_bit_for_bit(daemon):
    want = _straight(daemon.address, "py-resume-replace-straight", 2)
    model = _model()
    opt = DMuon(model, server=daemon.address, job_id="py-resume-replace", **HYPER)
    train(model, opt, 3, mlp_batch)
    opt.close()
    model = _model()
    opt = DMuon(model, daemon_options=DaemonOptions(
        daemon.address, job_id="py-resume-replace", resume="replace"), **HYPER)
    assert opt.session.step == 1
    train(model, opt, 2, mlp_batch)
    opt.close()
    _equal(want, model)


def test_continue_without_momentum_is_not_found(daemon):
    with pytest.raises(dmuon.Error) as e:
        DMuon(_model(), server=daemon.address, job_id="py-resume-nothing",
              resume=True, **HYPER)
    assert e.value.code == "NOT_FOUND"
    assert "job 'py-resume-nothing'" in str(e.value)
    assert "holds no momentum" in str(e.value)


def test_a_bad_resume_value_names_the_choices():
    for bad in (0, -3, 2.0, "later"):
        with pytest.raises(ValueError,
                           match=rf"DaemonOptions\(resume={bad!r}\) is not one of .*True"):
            DMuon(_model(), daemon_options=DaemonOptions(resume=bad))
    with pytest.raises(TypeError, match="both resume= and daemon_options="):
        DMuon(_model(), resume=True, daemon_options=DaemonOptions())


def test_load_state_dict_replaces_the_momentum_of_a_fresh_job(daemon):
    # A checkpoint of job A loaded into a new DMuon (a new, fresh job): the
    # run goes on as if never interrupted.
    want = _straight(daemon.address, "py-resume-ckpt-straight", 4)
    model = _model()
    opt = DMuon(model, server=daemon.address, job_id="py-resume-ckpt-a", **HYPER)
    train(model, opt, 2, mlp_batch)
    state = opt.state_dict()
    opt.close()
    again = copy.deepcopy(model)
    opt = DMuon(again, server=daemon.address, job_id="py-resume-ckpt-b", **HYPER)
    opt.load_state_dict(state)
    assert opt.session.step == 3
    train(again, opt, 2, mlp_batch, start=2)
    opt.close()
    _equal(want, again)


def test_low_level_client_modes(daemon):
    c = dmuon.Client(daemon.address)
    table = [("w", 8, 8)]
    s = c.open_session("py-resume-client", table, resume="fresh")
    assert s.step == 1
    s.close()  # no step completed: fresh again is fine
    s = c.open_session("py-resume-client", table, resume="replace")
    s.close()
    with pytest.raises(dmuon.Error, match="holds no momentum"):
        c.open_session("py-resume-client", table, resume="continue")
    with pytest.raises(dmuon.InvalidArgumentError, match="resume 'later'"):
        c.open_session("py-resume-client", table, resume="later")


def test_a_restarted_daemon_continues_from_its_snapshot(tmp_path):
    d = dmuon.LocalDaemon(flags=[f"--state-dir={tmp_path}"], stop_grace=5.0)
    try:
        want = _straight(d.address, "py-resume-disk-straight", 4)
        model = _model()
        opt = DMuon(model, server=d.address, job_id="py-resume-disk", **HYPER)
        train(model, opt, 2, mlp_batch)
        opt.close()
    finally:
        d.stop()  # SIGTERM: the final snapshot
    d = dmuon.LocalDaemon(flags=[f"--state-dir={tmp_path}"], stop_grace=5.0)
    try:
        with pytest.raises(dmuon.Error, match="snapshot under --state-dir"):
            DMuon(_model(), server=d.address, job_id="py-resume-disk", **HYPER)
        again = copy.deepcopy(model)
        opt = DMuon(again, server=d.address, job_id="py-resume-disk", resume=True,
                    **HYPER)
        assert opt.session.step == 3
        train(again, opt, 2, mlp_batch, start=2)
        opt.close()
        _equal(want, again)
    finally:
        d.stop()


def test_resume_at_a_step_the_trainer_never_got_is_exact(tmp_path):
    """Issue 27: dmuond killed (SIGKILL) after writing step 3's snapshot but
    before the trainer got step 3's step_complete. The trainer restarts from
    its checkpoint of step 2: resume=2 continues from step 2's momentum (the
    previous snapshot) and equals an uninterrupted run; resume=True would
    continue from step 3's, a step this trainer never applied."""
    import signal

    flags = [f"--state-dir={tmp_path}", "--snapshot-every=1"]
    d = dmuon.LocalDaemon(flags=flags, stop_grace=5.0)
    try:
        want = _biased()
        opt = DMuon(want, daemon_options=DaemonOptions(d.address, job_id="exact-straight"),
                    **HYPER)
        train(want, opt, 4, mlp_batch)
        opt.close()
        model = _biased()
        opt = DMuon(model, daemon_options=DaemonOptions(d.address, job_id="exact"), **HYPER)
        train(model, opt, 2, mlp_batch)
        checkpoint = copy.deepcopy((model.state_dict(), opt.local_state_dict()))
        train(model, opt, 1, mlp_batch, start=2)  # step 3: snapshotted, "never got"
    finally:
        d.process.send_signal(signal.SIGKILL)
        d.process.wait(30)
        d.stop()
    d = dmuon.LocalDaemon(flags=flags, stop_grace=5.0)
    try:
        with pytest.raises(dmuon.Error, match=r"cannot resume at completed step 1.*step 3"):
            DMuon(_biased(), daemon_options=DaemonOptions(d.address, job_id="exact", resume=1),
                  **HYPER)
        again = _biased()
        again.load_state_dict(checkpoint[0])
        # numpy's ints are steps too (a step read from a checkpoint's array).
        step = numpy.int64(2)
        opt = DMuon(again, daemon_options=DaemonOptions(d.address, job_id="exact", resume=step),
                    **HYPER)
        assert opt.session.step == 3
        opt.load_state_dict(checkpoint[1])
        train(again, opt, 2, mlp_batch, start=2)
        opt.close()
        _equal(want, again)
    finally:
        d.stop()


def _biased():
    torch.manual_seed(12)  # biases: AdamW's half, which dmuond does not keep
    return nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 10))


def test_the_resume_recipe_on_a_restarted_daemon(tmp_path):
    """Issue 29, item 2. dmuond with --state-dir keeps the Muon half only:
    the recipe is resume=True plus the checkpoint's optimizer state
    (local_state_dict: AdamW's, without the momentum). Followed, the run
    equals an uninterrupted one, with no warning (there was a false "Muon
    momentum starts from zero")."""
    import warnings

    d = dmuon.LocalDaemon(flags=[f"--state-dir={tmp_path}"], stop_grace=5.0)
    try:
        want = _biased()
        opt = DMuon(want, daemon_options=DaemonOptions(d.address, job_id="recipe-straight"),
                    **HYPER)
        train(want, opt, 4, mlp_batch)
        opt.close()
        model = _biased()
        opt = DMuon(model, daemon_options=DaemonOptions(d.address, job_id="recipe"), **HYPER)
        train(model, opt, 2, mlp_batch)
        checkpoint = (copy.deepcopy(model.state_dict()), opt.local_state_dict())
        opt.close()
    finally:
        d.stop()  # SIGTERM: the final snapshot
    d = dmuon.LocalDaemon(flags=[f"--state-dir={tmp_path}"], stop_grace=5.0)
    resumed = DaemonOptions(d.address, job_id="recipe", resume=True)
    try:
        again = _biased()
        again.load_state_dict(checkpoint[0])
        opt = DMuon(again, daemon_options=resumed, **HYPER)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            opt.load_state_dict(checkpoint[1])  # no false "starts from zero"
            train(again, opt, 2, mlp_batch, start=2)
        opt.close()
        _equal(want, again)
    finally:
        d.stop()


def test_resuming_without_the_optimizer_state_warns(daemon):
    """Without the checkpoint's optimizer state the first step warns that
    AdamW restarts from zero; with another step's, load_state_dict warns
    that the two halves disagree."""
    model = _biased()
    opt = DMuon(model, daemon_options=DaemonOptions(daemon.address, job_id="no-adamw"),
                **HYPER)
    train(model, opt, 1, mlp_batch)
    early = opt.local_state_dict()
    train(model, opt, 1, mlp_batch, start=1)
    opt.close()
    again = copy.deepcopy(model)
    opt = DMuon(again, daemon_options=DaemonOptions(
        daemon.address, job_id="no-adamw", resume=True), **HYPER)
    with pytest.warns(RuntimeWarning, match="AdamW's state was not loaded"):
        train(again, opt, 1, mlp_batch, start=2)
    opt.close()
    # Another step's AdamW state than dmuond's momentum: the halves disagree.
    opt = DMuon(copy.deepcopy(model), daemon_options=DaemonOptions(
        daemon.address, job_id="no-adamw", resume=True), **HYPER)
    with pytest.warns(RuntimeWarning, match="halves disagree"):
        opt.load_state_dict(early)
    opt.close()

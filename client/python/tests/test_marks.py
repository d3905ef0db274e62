"""DMuon's marks (issue 28 part 2, dmuon/_marks.py) against real dmuonds:
opt.mark() and state_dict()'s automatic mark; a reference checkpoint
(DaemonOptions(checkpoint_momentum="reference")) that holds no momentum,
resumed with resume=N exactly (torch.optim.Muon fp32 + AdamW as the oracle,
the "dmuon" entry dropped as DCP drops it too) and refused, naming the job,
both steps and the fix, when the job is elsewhere; and a daemon older than
protocol 1.5 (dmuond_minor0): mark() refused naming both versions,
state_dict() taken unmarked as the counted, warned-once fallback
'unmarked', which strict=True refuses. The multi-process crash test is
test_crash_resume.py."""

import copy
import os
import warnings

import pytest

import dmuon
import fsdp_worker
from dmuon import AdamWOptions, DaemonOptions, RoutingOptions
from dmuon.optim import DMuon
from helpers import rel_err
from torch_ref import ADAMW, MUON, muon_adamw_run

NAMES = ("0.weight", "2.weight", "4.weight")
TOL = 1e-5


def make(address, **daemon):
    """fsdp_worker's model (biases: AdamW's half) and a DMuon of it."""
    model = fsdp_worker.make_model()
    opt = DMuon(model, **MUON, adamw_options=AdamWOptions(**ADAMW),
                routing_options=RoutingOptions(muon=["4.weight"]),
                daemon_options=DaemonOptions(address, **daemon))
    return model, opt


def train(model, opt, start, stop):
    for s in range(start, stop):
        x, y = fsdp_worker.batch(s)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def reference(steps):
    def grads_of(model, s):
        x, y = fsdp_worker.batch(s)
        ((model(x) - y) ** 2).mean().backward()

    return muon_adamw_run(fsdp_worker.make_model(), NAMES, steps, grads_of)[0][-1]


def test_reference_checkpoint_resumes_at_its_mark_exactly(daemon):
    """Reference mode: state_dict() after step 3 marks it and holds each Muon
    parameter's "step" but no momentum; the run goes on to step 5 (dmuond's
    job moves past the checkpoint), the trainer "crashes"; a new optimizer
    opened with resume=3 loads the checkpoint and continues as one
    uninterrupted torch.optim.Muon + AdamW run."""
    model, opt = make(daemon.address, job_id="mark-ref",
                      checkpoint_momentum="reference")
    train(model, opt, 0, 1)
    assert opt.mark() == 1
    train(model, opt, 1, 3)
    sd = opt.state_dict()
    assert sd["dmuon"]["momentum_ref"] == {"job_id": "mark-ref", "step": 3}
    muon_keys = (0, 1, 2)  # the Muon group comes first
    for k in muon_keys:
        assert "momentum_buffer" not in sd["state"][k] and int(sd["state"][k]["step"]) == 3
    assert opt.stats["marks"] == [1, 3]
    assert opt.mark() == 3  # again: the same answer
    answer = opt.session.mark(3)  # the extension's call, by step
    assert answer["step"] == 3 and answer["marks"] == [1, 3]
    assert answer["mark_bytes"] == 2 * 4 * sum(p.numel() for p in (
        model[0].weight, model[2].weight, model[4].weight)) and answer["not_durable"] == ""
    with pytest.raises(dmuon.FailedPreconditionError, match="step 3"):
        opt.session.mark(2)  # not the step the job is at
    checkpoint = copy.deepcopy((model.state_dict(), sd))
    train(model, opt, 3, 5)  # past the checkpoint, then lost
    opt.close()

    # Loaded by an optimizer in the default "full" mode: a checkpoint whose
    # Muon parameters have a "step" but no momentum is a reference one
    # whatever the mode (as never stepped, zeros would overwrite the mark's).
    model, opt = make(daemon.address, job_id="mark-ref", resume=3)
    model.load_state_dict(checkpoint[0])
    dcp_like = {k: v for k, v in checkpoint[1].items() if k != "dmuon"}  # DCP's
    opt.load_state_dict(dcp_like)
    train(model, opt, 3, 6)
    opt.close()
    for name, p in reference(6).items():
        assert rel_err(dict(model.named_parameters())[name].detach(), p) < TOL, name


def test_reference_load_at_another_step_names_the_fix(daemon):
    """A reference checkpoint of step 2 loaded into the job at step 4 (opened
    with resume=True instead of resume=2) raises before anything changes,
    naming the job, both steps and DaemonOptions(job_id=..., resume=2); so
    does one naming another job."""
    model, opt = make(daemon.address, job_id="mark-wrong",
                      checkpoint_momentum="reference")
    train(model, opt, 0, 2)
    sd = copy.deepcopy(opt.state_dict())
    train(model, opt, 2, 4)
    opt.close()
    model, opt = make(daemon.address, job_id="mark-wrong", resume=True,
                      checkpoint_momentum="reference")
    before = opt.session.get_state()["momentum"]
    for state in (sd, {k: v for k, v in sd.items() if k != "dmuon"}):
        with pytest.raises(ValueError) as e:
            opt.load_state_dict(state)
        for part in ("job 'mark-wrong'", "step 2", "at step 4",
                     "DaemonOptions(job_id='mark-wrong', resume=2)"):
            assert part in str(e.value), (part, str(e.value))
    other = copy.deepcopy(sd)
    other["dmuon"]["momentum_ref"]["job_id"] = "another-job"
    with pytest.raises(ValueError, match="job_id='another-job', resume=2"):
        opt.load_state_dict(other)
    after = opt.session.get_state()["momentum"]
    assert all((a == b).all() for a, b in zip(before, after))
    opt.close()


def test_mark_mid_step_and_bad_mode_are_refused(daemon):
    with pytest.raises(ValueError, match="checkpoint_momentum='by-ref'"):
        make(daemon.address, checkpoint_momentum="by-ref")
    model, opt = make(daemon.address)
    x, y = fsdp_worker.batch(0)
    ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match=r"DMuon.mark\(\) in the middle of a step"):
        opt.mark()
    opt.close()


def _minor0():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    binary = os.path.join(root, "bazel-bin", "daemon", "dmuond_minor0")
    if not os.access(binary, os.X_OK):
        pytest.fail(f"{binary} is not built (`./dmuon test` builds it: "
                    "bazel build //daemon:dmuond_minor0)")
    return dmuon.LocalDaemon(binary=binary, stop_grace=1.0)


def test_an_older_daemon_takes_checkpoints_unmarked():
    """dmuond of protocol 1.0: mark() is refused naming both versions;
    state_dict() (reference mode too) carries the momentum in full,
    unmarked, counted once per step and warned once; strict=True refuses."""
    with _minor0() as d:
        model, opt = make(d.address, resume="auto", checkpoint_momentum="reference")
        train(model, opt, 0, 1)
        with pytest.raises(dmuon.FailedPreconditionError) as e:
            opt.mark()
        for part in ("speaks protocol 1.0", "needs protocol 1.5", "upgrade dmuond"):
            assert part in str(e.value), part
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sd = opt.state_dict()
            opt.state_dict()
            train(model, opt, 1, 2)
            opt.state_dict()
        unmarked = [w for w in caught if "fallback 'unmarked'" in str(w.message)]
        assert len(unmarked) == 1 and "protocol 1.0" in str(unmarked[0].message)
        assert opt.stats["fallbacks"]["unmarked"] == 2
        assert "momentum_ref" not in sd["dmuon"]
        assert all("momentum_buffer" in sd["state"][k] for k in (0, 1, 2))
        opt.close()
        model = fsdp_worker.make_model()
        opt = DMuon(model, **MUON, strict=True, adamw_options=AdamWOptions(**ADAMW),
                    routing_options=RoutingOptions(muon=["4.weight"]),
                    daemon_options=DaemonOptions(d.address, resume="auto"))
        train(model, opt, 0, 1)
        with pytest.raises(RuntimeError, match="refuses the fallback 'unmarked'"):
            opt.state_dict()
        opt.close()


def test_a_refused_mark_leaves_full_checkpoints_good_and_fails_reference_ones():
    """dmuond --mark-bytes=0 refuses every Mark (RESOURCE_EXHAUSTED naming
    the flag): a full checkpoint, which carries the momentum itself, is
    still taken (momentum equal to the oracle's), with the fallback
    'unmarked' counted and warned once; a reference checkpoint, useless
    without its mark, raises."""
    with dmuon.LocalDaemon(flags=["--mark-bytes=0"], stop_grace=1.0) as d:
        model, opt = make(d.address, job_id="refused-full")
        train(model, opt, 0, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sd = opt.state_dict()
        unmarked = [w for w in caught if "fallback 'unmarked'" in str(w.message)]
        assert len(unmarked) == 1, [str(w.message) for w in caught]
        assert "--mark-bytes" in str(unmarked[0].message)
        assert opt.stats["fallbacks"]["unmarked"] == 1
        key = {id(p): k for g, sg in zip(opt.param_groups, sd["param_groups"])
               for p, k in zip(g["params"], sg["params"])}

        def grads_of(m, s):
            x, y = fsdp_worker.batch(s)
            ((m(x) - y) ** 2).mean().backward()

        momenta = muon_adamw_run(fsdp_worker.make_model(), NAMES, 2, grads_of)[2][-1]
        for name, p in model.named_parameters():
            if name in NAMES:
                got = sd["state"][key[id(p)]]["momentum_buffer"]
                assert rel_err(got, momenta[name]) < TOL, name
        opt.close()
        model, opt = make(d.address, job_id="refused-ref", checkpoint_momentum="reference")
        train(model, opt, 0, 1)
        with pytest.raises(dmuon.Error) as e:
            opt.state_dict()
        assert e.value.code == "RESOURCE_EXHAUSTED" and "--mark-bytes" in str(e.value)
        assert "checkpoint_momentum='full'" in str(e.value)
        opt.close()

"""DMuon's marks (issue 28 part 2, dmuon/_marks.py) against real dmuonds:
mark() refused mid-step, a bad checkpoint_momentum refused; and a daemon older than
protocol 1.5 (dmuond_minor0): mark() refused naming both versions,
state_dict() taken unmarked as the counted, warned-once fallback
'unmarked', which strict=True refuses. The multi-process crash test is
test_crash_resume.py."""

import os
import warnings

import pytest

import dmuon
import fsdp_worker
from dmuon import AdamWOptions, DaemonOptions, RoutingOptions
from dmuon.optim import DMuon
from torch_ref import ADAMW, MUON

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

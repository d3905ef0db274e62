"""dmuond's durable state, as the trainer sees it.

A step dmuond was to make durable (--snapshot-every) whose snapshot could
not be written: the trainer is told (StepComplete.not_durable, one
RuntimeWarning per reason, DMuon.stats["not_durable_steps"]), and its
numbers are torch.optim.Muon's all the same. A snapshot found damaged when
dmuond starts: the job's next open says it starts from zero and where the
file went (OpenSessionResponse.notice), resume=True is refused saying so.

The write is made to fail the way a root-run daemon still fails (chmod does
not stop root): the job's snapshot file is replaced by a non-empty
directory, so the rename onto it fails; removing the directory makes the
next snapshot succeed again."""

import warnings

import pytest
import torch
from torch import nn

import dmuon
from dmuon import AdamWOptions, DaemonOptions, RoutingOptions
from dmuon.optim import DMuon
from helpers import rel_err
from torch_ref import ADAMW, MUON, TOL, fp32_muon


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(8, 12, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_snapshot_that_fails_is_reported_and_the_numbers_hold(tmp_path, monkeypatch):
    state = tmp_path / "state"
    d = dmuon.LocalDaemon(flags=[f"--state-dir={state}", "--snapshot-every=1"],
                          stop_grace=1.0)
    try:
        model = _model()
        opt = DMuon(model, **MUON, adamw_options=AdamWOptions(**ADAMW),
                    daemon_options=DaemonOptions(server=d.address, job_id="durability"),
                    routing_options=RoutingOptions(adamw=[model[2]]))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            _train(model, opt, 1, seed=1)  # durable: no warning
        (snapshot,) = [p for p in state.iterdir() if p.suffix == ".dmst"]
        assert opt.stats["not_durable_steps"] == 0
        snapshot.unlink()
        snapshot.mkdir()
        (snapshot / "keep").write_text("x")  # rename() onto it fails
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(model, opt, 2, seed=2)
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(said) == 1, said  # once per reason, not once per step
        assert "could not save step 2 of this job to its --state-dir" in said[0], said
        assert str(snapshot) in said[0] or snapshot.name in said[0], said
        assert opt.stats["not_durable_steps"] == 2
        (snapshot / "keep").unlink()
        snapshot.rmdir()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            _train(model, opt, 1, seed=3)  # durable again
        assert opt.stats["not_durable_steps"] == 2
        assert snapshot.is_file()
        opt.close()
    finally:
        d.stop()

    # The same 4 steps with torch.optim.Muon (fp32 Newton-Schulz) + AdamW.
    ref = _model()
    muon = fp32_muon(monkeypatch)([ref[0].weight], **MUON)
    adamw = torch.optim.AdamW([ref[0].bias, *ref[2].parameters()], **ADAMW)
    for seed, steps in ((1, 1), (2, 2), (3, 1)):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            ref(torch.randn(8, 12, generator=g)).square().mean().backward()
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(a.detach(), b.detach()) < TOL, name


def test_a_snapshot_found_unusable_at_start_is_announced(tmp_path):
    """dmuond restarted on a --state-dir whose snapshot of the job is damaged
    moves it aside; the job then starts from zero momentum, and DMuon says so
    (a RuntimeWarning naming where the file went) instead of silently
    training a resumed run from scratch; resume=True is refused saying it."""
    state = tmp_path / "state"
    flags = [f"--state-dir={state}", "--snapshot-every=1"]
    d = dmuon.LocalDaemon(flags=flags, stop_grace=1.0)
    try:
        model = _model()
        opt = DMuon(model, **MUON, daemon_options=DaemonOptions(server=d.address,
                                                                 job_id="damaged"))
        _train(model, opt, 2, seed=1)
        opt.close()
    finally:
        d.stop()
    (snapshot,) = [p for p in state.iterdir() if p.suffix == ".dmst"]
    data = bytearray(snapshot.read_bytes())
    data[len(data) // 2] ^= 0x5A
    snapshot.write_bytes(bytes(data))

    d = dmuon.LocalDaemon(flags=flags, stop_grace=1.0)
    try:
        model = _model()
        with pytest.raises(Exception, match="moved aside to .*corrupt-"):
            DMuon(model, **MUON, daemon_options=DaemonOptions(
                server=d.address, job_id="damaged", resume=True))
        with pytest.warns(RuntimeWarning) as caught:
            opt = DMuon(model, **MUON, daemon_options=DaemonOptions(
                server=d.address, job_id="damaged"))
        said = [str(w.message) for w in caught if "damaged" in str(w.message)]
        assert len(said) == 1, [str(w.message) for w in caught]
        assert "job 'damaged' starts from zero momentum at step 1" in said[0], said
        assert f"moved aside to {snapshot}.corrupt-" in said[0], said
        _train(model, opt, 1, seed=2)  # and it trains
        opt.close()
    finally:
        d.stop()

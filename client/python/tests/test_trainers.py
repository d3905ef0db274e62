"""DMuon inside the two trainers people use, with gradient clipping and
overlap on: transformers.Trainer (max_grad_norm=1.0) on a tiny random Llama,
and Lightning (gradient_clip_val) — each against the same run with
torch.optim.Muon (fp32 Newton-Schulz) + AdamW, 1e-5 per parameter every step
for 10 steps (examples/hf_trainer.py, examples/lightning_trainer.py), which
use no deprecated dmuon spelling (a DeprecationWarning of dmuon's fails them)."""

import copy
import os
import sys

import pytest

from helpers import DMUON_DEPRECATIONS_FAIL, rel_err
from torch_ref import TOL, fp32_muon

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))

# The examples must not use a deprecated dmuon spelling (helpers.py).
pytestmark = pytest.mark.filterwarnings(DMUON_DEPRECATIONS_FAIL)

STEPS = 10


def assert_steps_match(dm, ref):
    assert len(dm) == len(ref) == STEPS
    for step, (a, b) in enumerate(zip(dm, ref)):
        for n, (x, y) in enumerate(zip(a, b)):
            err = rel_err(x, y)
            assert err < TOL, f"step {step + 1}, parameter {n}: {err:.2e} relative"


def test_hf_trainer_with_max_grad_norm(daemon, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import hf_trainer
    Muon = fp32_muon(monkeypatch)
    model = hf_trainer.tiny_llama()
    ref_model = copy.deepcopy(model)
    _, dm, opt = hf_trainer.snapshots(model, STEPS,
                                      lambda m: hf_trainer.dmuon_for(m, daemon.address))
    _, ref, _ = hf_trainer.snapshots(ref_model, STEPS,
                                     lambda m: hf_trainer.MuonAdamW(m, Muon))
    assert_steps_match(dm, ref)
    assert opt.stats["steps"] == STEPS
    assert opt.stats["redone_steps"] > 0  # max_grad_norm=1.0 clipped


def test_lightning_with_gradient_clip_val(daemon, monkeypatch):
    pytest.importorskip("pytorch_lightning")
    import lightning_trainer
    Muon = fp32_muon(monkeypatch)
    dm, opt = lightning_trainer.run(STEPS, lambda m: lightning_trainer.dmuon_for(
        m, daemon.address))
    ref, _ = lightning_trainer.run(STEPS, lambda m: lightning_trainer.MuonAdamW(m, Muon))
    assert_steps_match(dm, ref)
    assert opt.stats["steps"] == STEPS
    assert opt.stats["redone_steps"] > 0

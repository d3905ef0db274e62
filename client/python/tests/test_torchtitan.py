"""dmuon.integrations.torchtitan: torchtitan 0.3.0's own Trainer (a tiny
debug llama, FSDP2 over 2 gloo ranks, gradient clipping, LR warmup and
decay) with DMuonOptimizersContainer against the same job with
torch.optim.Muon (fp32 Newton-Schulz) + AdamW through torchtitan's own
OptimizersContainer, and DMuon's checkpoint through torchtitan's
CheckpointManager (titan_worker.py; the CPU accommodations are
titan_cpu.py's)."""

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is optional: pip install torchtitan==0.3.0")

from helpers import rel_err  # noqa: E402
from ranks import launch  # noqa: E402

TOL = 1e-5
WORLD = 2


@pytest.fixture(scope="module")
def job(daemon, tmp_path_factory):
    """run(mode, *extra): rank 0's dict of a titan_worker job, each job in
    its own folder; the uninterrupted DMuon and torch runs are made once."""
    made = {}

    def run(mode, *extra, dump=None):
        key = (mode, *extra)
        if key not in made:
            tmp = tmp_path_factory.mktemp(mode)
            dump = dump or tmp / "dump"
            made[key] = launch("titan_worker.py", mode, WORLD, daemon.address, tmp,
                               extra=(f"--dump={dump}", *extra), timeout=180)[0][0]
        return made[key]

    return run


def differences(a, b):
    """{fqn: relative difference} of two runs' parameters, and of their
    losses and gradient norms ("loss 3", "grad_norm 3"), step by step."""
    out = {n: rel_err(a["params"][n], p) for n, p in b["params"].items()}
    assert [s for s, _, _ in a["losses"]] == [s for s, _, _ in b["losses"]]
    for (step, la, ga), (_, lb, gb) in zip(a["losses"], b["losses"]):
        out[f"loss {step}"] = abs(la - lb) / abs(lb)
        out[f"grad_norm {step}"] = abs(ga - gb) / abs(gb)
    return out


def test_param_groups_are_refused():
    """torchtitan's own ParamGroupConfig routing is not DMuon's: refused,
    naming adamw_patterns, before any DMuon is made."""
    from torch import nn
    from torchtitan.components.optimizer import ParamGroupConfig

    from dmuon.integrations.torchtitan import DMuonOptimizersContainer

    config = DMuonOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW")])
    with pytest.raises(ValueError, match="adamw_patterns"):
        config.build(model_parts=[nn.Linear(4, 4)])


def test_one_job_id_for_several_parts_is_refused():
    """One DMuon per model part: an explicit job_id would be opened twice."""
    from torch import nn

    from dmuon.integrations.torchtitan import DMuonOptimizersContainer

    config = DMuonOptimizersContainer.Config(job_id="run-1")
    with pytest.raises(ValueError, match="job_id='run-1' with 2 model parts"):
        config.build(model_parts=[nn.Linear(4, 4), nn.Linear(4, 4)])


def test_routes(job):
    """Matrices to Muon, the head (adamw_patterns' default), embedding and
    norms to AdamW: the ParamGroupConfig split of the torch side."""
    routes = job("dmuon")["routes"]
    muon = sorted(n for n, r in routes.items() if r == "muon")
    assert muon == sorted(f"layers.{i}.{m}.weight" for i in range(2)
                          for m in ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1",
                                    "feed_forward.w2", "feed_forward.w3")), routes
    assert routes["lm_head.weight"] == "adamw"
    assert routes["tok_embeddings.weight"] == "adamw"


def test_trainer_equals_torch_muon_adamw(job):
    """6 steps of torchtitan's Trainer: every parameter, loss and gradient
    norm equal to torch.optim.Muon + AdamW's at 1e-5 relative; clipping on
    every step."""
    dm, ref = job("dmuon"), job("torch")
    assert len(ref["losses"]) == 6 and all(g > 0.5 for _, _, g in ref["losses"]), ref["losses"]
    worst = differences(dm, ref)
    assert max(worst.values()) < TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:5]


def test_without_overlap_equals_torch_muon_adamw(job):
    """overlap_backward=False (gradients handed over in step(), after the
    clipping): the same numbers."""
    worst = differences(job("dmuon", "--no-overlap"), job("torch"))
    assert max(worst.values()) < TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:5]


def test_comparison_sees_another_lr(job):
    """The comparison can fail: DMuon with its Muon lr 1% off is caught."""
    worst = differences(job("dmuon", "--lr-scale=1.01"), job("torch"))
    assert max(worst.values()) > 100 * TOL


def test_checkpoint_resume(job, tmp_path):
    """Saved by torchtitan's CheckpointManager at step 3 (the job then ends
    without closing, as if killed), resumed by fresh processes, a fresh
    Trainer and DMuon to step 6: the uninterrupted run's parameters."""
    dump = tmp_path / "dump"
    saved = job("save", "--save-at=3", dump=dump)
    assert saved["step"] == 3 and (dump / "checkpoint" / "step-3").is_dir()
    resumed = job("resume", "--save-at=3", dump=dump)
    whole = job("dmuon")
    assert [s for s, _, _ in resumed["losses"]] == [4, 5, 6]
    worst = differences(resumed, dict(whole, losses=whole["losses"][3:]))
    assert max(worst.values()) < TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:5]

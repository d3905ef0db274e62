"""2-process torch.distributed (gloo on 127.0.0.1) jobs against one dmuond."""

import pytest
import torch

import dist_worker
from dmuon.optim import DMuon
from helpers import TinyLM, lm_batch, loss_of, rel_err
from ranks import launch

STEPS = 8  # dist_worker.STEPS
HYPER = dict(lr=0.02, weight_decay=0.1, adamw_lr=3e-3)


def run_job(mode, address, tmp_path, world=2):
    return launch("dist_worker.py", mode, world, address, tmp_path, check=False)


@pytest.fixture(scope="module")
def single(daemon):
    """The single-process run on the whole batch."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = DMuon(model, server=daemon.address, adamw=[model.head], **HYPER)
    for s in range(STEPS):
        loss_of(model, lm_batch(s)).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode,server", [("ddp", "fixture"), ("ddp_reduce", "fixture"),
                                         ("ddp_ignore", "fixture"), ("ddp_accum", "auto")])
def test_ddp_equals_single_process(daemon, single, tmp_path, mode, server):
    """server "auto": rank 0 starts a private dmuond and the ranks share it."""
    results, logs = run_job(mode, daemon.address if server == "fixture" else "auto",
                            tmp_path)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}\n{logs[rank]}"
        for name, want in single.items():
            assert rel_err(r["params"][name], want) < 1e-5, (rank, name)
    want = {"ddp": ("replicated", "ddp"), "ddp_reduce": ("unreduced", "ddp"),
            "ddp_accum": ("unreduced", "ddp"), "ddp_ignore": ("unreduced", "hook")}[mode]
    routes = results[0]["routes"]
    # Replicated: DDP all-reduced every gradient. reduce_in_daemon: the Muon
    # gradients stayed local (the daemon averages them), AdamW's were reduced.
    assert routes.pop("adamw_grads_equal")
    assert routes.pop("muon_grads_equal") == (mode == "ddp")
    assert set(routes.values()) == {want}
    for name in single:  # every rank holds the same model
        assert torch.equal(results[0]["params"][name], results[1]["params"][name]), name


@pytest.mark.parametrize("mode", ["unused_ddp", "unused_daemon"])
def test_matrix_unused_on_some_ranks_or_steps(daemon, tmp_path, mode):
    """A Muon matrix used on rank 0 only, every other step: the same as one
    process averaging the two ranks' losses (torch.optim.Muon skips it in
    the steps no rank uses it, and the other steps' gradient is rank 0's
    averaged with zeros). unused_ddp: DDP(find_unused_parameters=True)
    reduces, and DMuon hands off at step() (its comm hook would see zeros
    for the skipped steps); unused_daemon: reduce_in_daemon, rank 1 declares
    the matrix absent, dmuond averages, and both ranks apply the update."""
    torch.manual_seed(0)
    model = dist_worker._Branchy()
    opt = DMuon(model, server=daemon.address, **HYPER)
    for s in range(STEPS):
        loss = 0
        for rank in range(2):
            x, y = dist_worker.unused_batch(s, rank)
            use = s % 2 == 1 and rank == 0
            loss = loss + torch.nn.functional.mse_loss(model(x, use), y) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    results, logs = run_job(mode, daemon.address, tmp_path)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}\n{logs[rank]}"
        for name, want in model.named_parameters():
            assert rel_err(r["params"][name], want.detach()) < 1e-5, (rank, name)
            assert torch.equal(r["params"][name], results[0]["params"][name])
    assert (results[0]["routes"] == {"handoff": "step", "sharding": "replicated"}
            if mode == "unused_ddp" else {"handoff": "hook", "sharding": "unreduced"})


@pytest.mark.parametrize("mode", ["rows", "rows_cycled"])
def test_row_sharded_parameter_equals_whole_matrix(daemon, tmp_path, mode):
    """rows_cycled: with OneCycleLR cycling the momentum (each rank sends the
    step's momentum with its rows)."""
    results, logs = run_job(mode, daemon.address, tmp_path)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}\n{logs[rank]}"
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 24) * 0.1)
    opt = DMuon([w], server=daemon.address, lr=0.02, weight_decay=0.1)
    sched = (torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.04, total_steps=STEPS)
             if mode == "rows_cycled" else None)
    for s in range(STEPS):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(8, 24, generator=g), torch.randn(8, 16, generator=g)
        ((x @ w.t() - y) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    opt.close()
    got = torch.cat([results[0]["params"]["w"], results[1]["params"]["w"]])
    assert rel_err(got, w.detach()) < 1e-5
    if mode == "rows":  # state_dict(): the whole matrix, in the "dmuon" entry
        for r in results:
            checks = r["routes"]
            assert checks["state"] == ["step"] and checks["same"], checks
            assert checks["whole"] == {"params[0][0]": (16, 24)}, checks
            assert "no momentum for 'params[0][0]'" in checks["without_dmuon"], checks


def test_mismatch_between_ranks_fails_on_every_rank(daemon, tmp_path):
    results, logs = run_job("mismatch", daemon.address, tmp_path)
    errors = [r["error"] for r in results]
    assert all(errors), errors
    assert any("does not match rank" in e and "shape" in e for e in errors), errors
    assert any("could not open its dmuond session" in e for e in errors) or all(
        "does not match" in e for e in errors), errors

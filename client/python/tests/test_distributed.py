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
                                         ("ddp_ignore", "fixture"), ("ddp_accum", "auto"),
                                         ("ddp_accum_sync", "fixture")])
def test_ddp_equals_single_process(daemon, single, tmp_path, mode, server):
    """server "auto": rank 0 starts a private dmuond and the ranks share it."""
    results, logs = run_job(mode, daemon.address if server == "fixture" else "auto",
                            tmp_path)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}\n{logs[rank]}"
        for name, want in single.items():
            assert rel_err(r["params"][name], want) < 1e-5, (rank, name)
    want = {"ddp": ("replicated", "ddp"), "ddp_accum_sync": ("replicated", "ddp"),
            "ddp_reduce": ("unreduced", "ddp"),
            "ddp_accum": ("unreduced", "ddp"), "ddp_ignore": ("unreduced", "hook")}[mode]
    routes = results[0]["routes"]
    # Replicated: DDP all-reduced every gradient. reduce_in_daemon: the Muon
    # gradients stayed local (the daemon averages them), AdamW's were reduced.
    assert routes.pop("redone_steps") == 0
    # Two all-reduced backwards a step (no no_sync()): DDP's comm hook hands
    # off during each, so every step's first hand-off is rewound, on every
    # rank, at the second backward (exact; no_sync() avoids the rewinds).
    assert routes.pop("rewound_steps") == (STEPS if mode == "ddp_accum_sync" else 0)
    assert routes.pop("adamw_grads_equal")
    assert routes.pop("muon_grads_equal") == (mode in ("ddp", "ddp_accum_sync"))
    assert set(routes.values()) == {want}
    for name in single:  # every rank holds the same model
        assert torch.equal(results[0]["params"][name], results[1]["params"][name]), name


def test_ddp_clipping_after_backward_is_rewound_on_every_rank(daemon, tmp_path):
    """overlap=True hands every Muon gradient off during backward; DDP's
    all-reduced gradients then clipped (clip_grad_norm_, as HF Trainer and
    Lightning do): every rank rewinds dmuond's step (rank 0 sees the edit of
    the replicated gradients, the others learn it from one all-reduce) and
    re-declares the clipped ones. Equal to one process clipping the
    full-batch gradient."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = DMuon(model, server=daemon.address, adamw=[model.head], overlap=False, **HYPER)
    for s in range(STEPS):
        loss_of(model, lm_batch(s)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), dist_worker.CLIP)
        opt.step()
        opt.zero_grad()
    opt.close()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    results, logs = run_job("ddp_clip", daemon.address, tmp_path)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}\n{logs[rank]}"
        assert r["routes"]["redone_steps"] == STEPS, (rank, r["routes"])
        for name, w in want.items():
            assert rel_err(r["params"][name], w) < 1e-5, (rank, name)
    for name in want:
        assert torch.equal(results[0]["params"][name], results[1]["params"][name]), name


def test_reduce_in_daemon_clipping_local_gradients_rewinds_on_every_rank(
        daemon, tmp_path):
    """reduce_in_daemon=True: each rank clips its own (local, unreduced) Muon
    gradients by its own norm, so the edits differ by rank. There is no
    single-process equivalent (DDP-style training would clip the averaged
    gradient; here each rank's AdamW even steps with its own clip factor),
    so the reference is that loop with overlap=False, whose gradients leave
    at step(), after the clipping: dmuond averages the clipped local
    gradients. overlap=True must rewind on every rank and give the same
    numbers."""
    got, logs = run_job("ddp_reduce_clip", daemon.address, tmp_path)
    want, wlogs = run_job("ddp_reduce_clip_nooverlap", daemon.address, tmp_path)
    for rank in range(2):
        assert got[rank]["error"] is None, f"rank {rank}: {got[rank]['error']}\n{logs[rank]}"
        assert want[rank]["error"] is None, f"rank {rank}: {want[rank]['error']}\n{wlogs[rank]}"
        assert got[rank]["routes"]["redone_steps"] == STEPS, (rank, got[rank]["routes"])
        assert want[rank]["routes"]["redone_steps"] == 0
        for name, w in want[rank]["params"].items():
            assert rel_err(got[rank]["params"][name], w) < 1e-6, (rank, name)


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

"""server=[a, b]: one job split over a pool of daemons (each matrix on one)."""

import copy
import io

import pytest
import torch

import dmuon
from dmuon.optim import DMuon
from helpers import TinyLM, lm_batch, loss_of, rel_err, train


def test_pool_equals_one_daemon_and_checkpoints_move_between_them(daemon):
    torch.manual_seed(4)
    one = TinyLM()
    pooled = copy.deepcopy(one)
    with dmuon.LocalDaemon(stop_grace=1.0) as a, dmuon.LocalDaemon(stop_grace=1.0) as b:
        o1 = DMuon(one, lr=0.02, server=daemon.address, adamw=[one.head])
        op = DMuon(pooled, lr=0.02, server=[a.address, b.address], adamw=[pooled.head])
        train(one, o1, 5, lm_batch)
        train(pooled, op, 5, lm_batch)
        for (n, x), y in zip(one.named_parameters(), pooled.parameters()):
            assert torch.equal(x, y), n
        # A pool's checkpoint resumes on a single daemon. It goes through
        # torch.save as a real one does: since torch 2.0, load_state_dict keeps
        # the tensors it is given (AdamW's step and moments), so an in-process
        # hand-over would share them with the live optimizer.
        buf = io.BytesIO()
        torch.save({"model": pooled.state_dict(), "opt": op.state_dict()}, buf)
        buf.seek(0)
        # state_dict() marked step 5 on both daemons: the pool's answer is
        # the steps both hold and the bytes of both (every Muon matrix once).
        assert op.stats["marks"] == [5]
        answer = op.session.mark()
        muon = sum(p.numel() for g in op.param_groups if g["use_muon"] for p in g["params"])
        assert (answer["step"], answer["marks"], answer["mark_bytes"]) == (5, [5], 4 * muon)
        ckpt = torch.load(buf)
        fresh = TinyLM()
        fresh.load_state_dict(ckpt["model"])
        o2 = DMuon(fresh, lr=0.02, server=daemon.address, adamw=[fresh.head])
        o2.load_state_dict(ckpt["opt"])
        train(fresh, o2, 3, lm_batch, start=5)
        train(pooled, op, 3, lm_batch, start=5)
        for (n, x), y in zip(fresh.named_parameters(), pooled.parameters()):
            assert torch.equal(x, y), n
        for o in (o1, o2, op):
            o.close()


TABLE = [(f"w{i}", 32, 32) for i in range(9)]


def test_plan_pool_follows_device_counts_and_pool_owner_is_used_as_is():
    with dmuon.LocalDaemon(flags=["--cpu-executors=3"], stop_grace=1.0) as a, \
            dmuon.LocalDaemon(stop_grace=1.0) as b:
        client = dmuon.Client([a.address, b.address])
        assert client.device_counts() == [3, 1]
        owner = dmuon.plan_pool(TABLE, client.device_counts())
        assert owner == dmuon.plan_pool(TABLE, [3, 1])  # deterministic
        assert owner.count(0) in (6, 7) and owner.count(1) in (2, 3)
        assert dmuon.plan_pool(TABLE, [1, 1]) != owner
        # Explicit owners are honoured: each daemon holds what it was given.
        mine = [1, 1, 0, 1, 1, 1, 1, 1, 1]
        s = client.open_session("owned", TABLE, transport="inline", pool_owner=mine)
        assert len(s) == len(TABLE)
        s.close()
        with pytest.raises(dmuon.InvalidArgumentError, match="pool_owner has 2"):
            client.open_session("short", TABLE, pool_owner=[0, 1])
        with pytest.raises(dmuon.InvalidArgumentError, match="'w4'"):
            client.open_session("range", TABLE, pool_owner=[0, 1, 0, 1, 2, 0, 1, 0, 1])


def test_ddp_ranks_share_rank_0s_plan_of_an_unequal_pool(daemon, tmp_path):
    """2 processes over a 3-executor and a 1-executor daemon: both ranks use
    the owners rank 0 planned, and train as one process on one daemon does."""
    import test_distributed as td

    with dmuon.LocalDaemon(flags=["--cpu-executors=3"], stop_grace=1.0) as a, \
            dmuon.LocalDaemon(stop_grace=1.0) as b:
        results, logs = td.run_job("ddp_pool", f"{a.address},{b.address}", tmp_path)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}\n{logs[rank]}"
    owners = [r["routes"]["pool_owner"] for r in results]
    assert owners[0] is not None and owners[0] == owners[1], owners
    assert set(owners[0]) == {0, 1} and owners[0].count(0) > owners[0].count(1)
    torch.manual_seed(0)
    model = TinyLM()
    opt = DMuon(model, server=daemon.address, adamw=[model.head], **td.HYPER)
    for s in range(td.STEPS):
        loss_of(model, lm_batch(s)).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    for name, want in model.named_parameters():
        for r in results:
            assert rel_err(r["params"][name], want.detach()) < 1e-5, name

"""server=[a, b]: one job split over a pool of daemons (each matrix on one)."""

import copy

import torch

import dmuon
from dmuon.torch import DMuon
from helpers import TinyLM, lm_batch, train


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
        # A pool's checkpoint resumes on a single daemon.
        fresh = TinyLM()
        fresh.load_state_dict(pooled.state_dict())
        o2 = DMuon(fresh, lr=0.02, server=daemon.address, adamw=[fresh.head])
        o2.load_state_dict(op.state_dict())
        train(fresh, o2, 3, lm_batch, start=5)
        train(pooled, op, 3, lm_batch, start=5)
        for (n, x), y in zip(fresh.named_parameters(), pooled.parameters()):
            assert torch.equal(x, y), n
        for o in (o1, o2, op):
            o.close()

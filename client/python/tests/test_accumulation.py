"""Gradient accumulation: hand off only the last micro-batch's gradient."""

import copy

import pytest
import torch

from dmuon.optim import DMuon
from helpers import MLP, loss_of, max_rel_err, mlp_batch


def test_accumulation_equals_the_large_batch_step(daemon):
    torch.manual_seed(5)
    big, acc, acc_step = MLP(), None, None
    acc = copy.deepcopy(big)
    acc_step = copy.deepcopy(big)
    o_big = DMuon(big, lr=0.02, server=daemon.address)
    o_acc = DMuon(acc, lr=0.02, server=daemon.address)
    o_step = DMuon(acc_step, lr=0.02, server=daemon.address, overlap=False)
    for s in range(6):
        x, y = mlp_batch(s, n=32)
        loss_of(big, (x, y)).backward()
        o_big.step()
        o_big.zero_grad()
        for k in range(4):  # four micro-batches of 8
            part = (x[8 * k:8 * k + 8], y[8 * k:8 * k + 8])
            if k < 3:
                with o_acc.no_sync():
                    (loss_of(acc, part) / 4).backward()
            else:
                (loss_of(acc, part) / 4).backward()
            (loss_of(acc_step, part) / 4).backward()  # overlap=False: no no_sync
        o_acc.step()
        o_acc.zero_grad()
        o_step.step()
        o_step.zero_grad()
    assert max_rel_err(acc, big) < 1e-5
    assert max_rel_err(acc_step, big) < 1e-5
    for o in (o_big, o_acc, o_step):
        o.close()


def test_accumulating_without_no_sync_equals_the_large_batch_step(daemon):
    """torch's way (no no_sync): the first step's second backward rewinds
    dmuond's step once; later steps hand off at step() (no rewind)."""
    torch.manual_seed(6)
    big = MLP()
    acc = copy.deepcopy(big)
    o_big = DMuon(big, lr=0.02, server=daemon.address)
    o_acc = DMuon(acc, lr=0.02, server=daemon.address)
    for s in range(4):
        x, y = mlp_batch(s, n=32)
        loss_of(big, (x, y)).backward()
        o_big.step()
        o_big.zero_grad()
        for k in range(4):
            (loss_of(acc, (x[8 * k:8 * k + 8], y[8 * k:8 * k + 8])) / 4).backward()
        o_acc.step()
        o_acc.zero_grad()
        assert max_rel_err(acc, big) < 1e-5, s
    assert o_acc.stats["rewound_steps"] == 1
    for o in (o_big, o_acc):
        o.close()

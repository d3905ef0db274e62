"""DMuon in today's training loops, each side by side with torch.optim.Muon
(fp32 Newton–Schulz) + AdamW: nn.MultiheadAttention and
nn.TransformerEncoderLayer with overlap_forward, torch.compile, bf16
autocast on the CPU, activation checkpointing (both flavours) and several
DMuon instances in one process (pipeline stages)."""

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn

from dmuon.optim import DMuon
from helpers import muon_split
from torch_ref import DM_ADAMW, MUON, ADAMW, assert_same, fp32_muon, pair

pytestmark = pytest.mark.timeout(60)


def _refs(monkeypatch, model):
    mats, others = muon_split(model)
    return fp32_muon(monkeypatch)(mats, **MUON), torch.optim.AdamW(others, **ADAMW)


def _batch(step, n=8, t=6, d=16):
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(n, t, d, generator=g), torch.randn(n, t, d, generator=g)


def _loss(model, step, call=None):
    x, y = _batch(step)
    return (((model if call is None else call)(x) - y) ** 2).mean()


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        # bias=False: the key bias's gradient is ~0 (softmax ignores it), and
        # AdamW turns two runs' roundings of ~0 into different +-lr steps.
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True, bias=False)
        self.enc = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                              batch_first=True, bias=False)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        h, _ = self.mha(x, x, x, need_weights=False)
        return self.out(self.enc(x + h))


def _train(monkeypatch, daemon, make, steps=4, call=None, ctx=None, **kw):
    ref, dm = pair(make, seed=21)
    muon, adamw = _refs(monkeypatch, ref)
    opt = DMuon(dm, **MUON, **DM_ADAMW, server=daemon.address, **kw)
    for step in range(steps):
        with ctx() if ctx else torch.enable_grad():
            loss = _loss(ref, step)
        loss.backward()
        muon.step(), adamw.step(), muon.zero_grad(), adamw.zero_grad()
        with ctx() if ctx else torch.enable_grad():
            loss = _loss(dm, step, call(dm) if call else None)
        loss.backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        assert_same(ref, dm, step)
    return opt


@pytest.mark.parametrize("overlap_forward", [False, True])
def test_multihead_attention_and_encoder_layer(monkeypatch, daemon, overlap_forward):
    """out_proj's forward is never called (MultiheadAttention reads its
    weight): with overlap_forward its update is applied by the attention
    module's pre-hook, before the forward uses it (it used to be applied
    after, by the root's hook: an in-place error in the next backward)."""
    opt = _train(monkeypatch, daemon, Attn, overlap_forward=overlap_forward)
    names = {r["name"] for r in opt.routing if r["route"] == "muon"}
    assert {"mha.in_proj_weight", "mha.out_proj.weight",
            "enc.self_attn.out_proj.weight", "enc.linear1.weight"} <= names
    opt.close()


def test_bf16_autocast_cpu(monkeypatch, daemon):
    _train(monkeypatch, daemon, Attn,
           ctx=lambda: torch.autocast("cpu", dtype=torch.bfloat16)).close()


class Deep(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.a = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.b = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        x = x.requires_grad_() if self.reentrant else x
        h = ckpt.checkpoint(self.a, x, use_reentrant=self.reentrant)
        h = ckpt.checkpoint(self.b, h, use_reentrant=self.reentrant)
        return self.out(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("overlap_forward", [False, True])
def test_activation_checkpointing(monkeypatch, daemon, reentrant, overlap_forward):
    """The forward is run again inside backward: pre-hooks fire again (no
    update is pending then) and each gradient is handed over once (a
    reentrant checkpoint's inner backward is a graph task of its own)."""
    opt = _train(monkeypatch, daemon, lambda: Deep(reentrant),
                 overlap_forward=overlap_forward)
    assert opt.stats.get("voided_steps", 0) == 0
    assert opt.stats.get("rewound_steps", 0) == 0
    opt.close()


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_several_instances_pipeline_stages(monkeypatch, daemon):
    """Two stages, each with its own DMuon (its own dmuond job), one
    backward through both."""
    torch.manual_seed(3)
    stages = [Stage(), Stage()]
    import copy
    refs = [copy.deepcopy(s) for s in stages]
    fp32_muon(monkeypatch)
    ref_opts = [o for s in refs for o in (
        torch.optim.Muon([s.fc1.weight, s.fc2.weight], **MUON),
        torch.optim.AdamW([s.fc1.bias, s.fc2.bias], **ADAMW))]
    opts = [DMuon(s, **MUON, **DM_ADAMW, server=daemon.address) for s in stages]
    assert opts[0].job_id != opts[1].job_id
    for step in range(4):
        x, y = _batch(step)
        ((refs[1](refs[0](x)) - y) ** 2).mean().backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
        ((stages[1](stages[0](x)) - y) ** 2).mean().backward()
        for o in reversed(opts):  # the last stage's first, as a pipeline does
            o.step()
            o.zero_grad()
        for r, s in zip(refs, stages):
            assert_same(r, s, step)
    for o in opts:
        o.close()


@pytest.mark.timeout(180)  # inductor: ~30 s idle, 75 s on 2 loaded cores
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile(monkeypatch, daemon, backend):
    """torch.compile(model): DMuon's hooks stay outside the compiled graph
    (gradient hooks run in eager autograd; the forward pre-hook is traced
    with the module), the numbers are torch's. inductor compiles C++ on the
    CPU: the slowest test here."""
    torch._dynamo.reset()
    compiled = {}

    def call(m):
        if m not in compiled:
            compiled[m] = torch.compile(m, backend=backend)
        return compiled[m]

    opt = _train(monkeypatch, daemon, Stage, steps=2, call=call)
    opt.close()


@pytest.mark.timeout(120)
def test_compiled_autograd_refused_with_overlap_works_without(monkeypatch, daemon):
    """Compiled autograd traces backward's hooks: DMuon's overlap hooks
    (I/O with dmuond) are refused at construction, naming it; overlap=False
    (hand-off in step()) trains equal to torch's."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(compiled_autograd=True):
        with pytest.raises(ValueError, match=r"compiled autograd.*overlap_options="
                                             r"OverlapOptions\(backward=False\)"):
            DMuon(Stage(), server=daemon.address)
        opt = _train(monkeypatch, daemon, Stage, steps=3, overlap=False,
                     call=lambda m: torch.compile(m, backend="eager"))
    opt.close()

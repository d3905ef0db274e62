"""A small GPT-style character model on a text every Debian machine has, and
the three optimizers the demo and the client benchmark compare:

  adamw  torch.optim.AdamW on every parameter
  muon   in-process Muon written here in plain torch (torch.optim.Muon's
         update, fp32 Newton-Schulz) on the matrices + AdamW on the rest
  dmuon  dmuon.optim.DMuon: the matrices through dmuond, AdamW on the rest
"""

import math
import os
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # client/python: the dmuon package

CORPUS = "/usr/share/common-licenses/GPL-3"
MUON = dict(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


class Corpus:
    def __init__(self, path=CORPUS, device="cpu"):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        self.chars = sorted(set(text))
        self.vocab = len(self.chars)
        index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.device = device

    def batch(self, step, batch=16, block=64, seed=1234):
        g = torch.Generator().manual_seed(seed + step)
        starts = torch.randint(0, len(self.data) - block - 1, (batch,), generator=g)
        x = torch.stack([self.data[s:s + block] for s in starts])
        y = torch.stack([self.data[s + 1:s + block + 1] for s in starts])
        return x.to(self.device), y.to(self.device)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d=128, heads=4, layers=4, block=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))

    def matrices(self):
        """What Muon gets: the blocks' 2-D weights (not embeddings, not the head)."""
        return [p for n, p in self.named_parameters() if n.startswith("blocks.") and p.dim() == 2]


def newton_schulz(u, steps=5, eps=1e-7, coefficients=(3.4445, -4.775, 2.0315)):
    """torch.optim.Muon's NS, in fp32 (torch's own runs it in bf16)."""
    a, b, c = coefficients
    x = u.t() if u.shape[0] > u.shape[1] else u
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.t()
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.t() if u.shape[0] > u.shape[1] else x


class InProcessMuon:
    """torch.optim.Muon's update (2.9) on `matrices`, AdamW on `others`."""

    def __init__(self, matrices, others, lr, weight_decay, momentum, nesterov, adamw):
        self.matrices, self.lr, self.wd = list(matrices), lr, weight_decay
        self.mu, self.nesterov = momentum, nesterov
        self.bufs = [torch.zeros_like(p) for p in self.matrices]
        self.adamw = torch.optim.AdamW(others, **adamw)

    @torch.no_grad()
    def step(self):
        for p, buf in zip(self.matrices, self.bufs):
            buf.lerp_(p.grad, 1 - self.mu)
            u = p.grad.lerp(buf, self.mu) if self.nesterov else buf
            o = newton_schulz(u)
            scale = math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
            p.mul_(1 - self.lr * self.wd)
            p.add_(o, alpha=-self.lr * scale)
        self.adamw.step()

    def zero_grad(self):
        for p in self.matrices:
            p.grad = None
        self.adamw.zero_grad(set_to_none=True)


def make_optimizer(kind, model, server="auto", daemon_flags=(), overlap=True):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), **ADAMW)
    mats = model.matrices()
    ids = {id(p) for p in mats}
    others = [p for p in model.parameters() if id(p) not in ids]
    if kind == "muon":
        return InProcessMuon(mats, others, adamw=ADAMW, **MUON)
    if kind == "dmuon":
        from dmuon import AdamWOptions, DaemonOptions, OverlapOptions, RoutingOptions
        from dmuon.optim import DMuon

        return DMuon(model, **MUON,
                     adamw_options=AdamWOptions(**ADAMW),
                     daemon_options=DaemonOptions(server, flags=daemon_flags),
                     routing_options=RoutingOptions(adamw=[model.head]),
                     overlap_options=OverlapOptions(backward=overlap))
    raise ValueError(f"unknown optimizer {kind!r}")


def train(kind, corpus, steps, device="cpu", server="auto", seed=0, progress=None,
          skip=0, clip=None, overlap=True):
    """Trains a fresh model (same init for every kind); returns losses and
    per-step timings (iteration, step() call) in seconds. clip: max_norm of a
    clip_grad_norm_ after backward (counted in the step's time); overlap:
    DMuon's."""
    torch.manual_seed(seed)
    model = GPT(corpus.vocab).to(device)
    opt = make_optimizer(kind, model, server, overlap=overlap)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    losses, iters, steps_t = [], [], []
    t_start = time.perf_counter()
    for s in range(steps):
        x, y = corpus.batch(s)
        sync()
        t0 = time.perf_counter()
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        sync()
        t1 = time.perf_counter()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sync()
        t2 = time.perf_counter()
        opt.zero_grad()
        losses.append(loss.item())
        iters.append(t2 - t0)
        steps_t.append(t2 - t1)
        if progress:
            progress(kind, s + 1, steps, losses[-1], time.perf_counter() - t_start)
    extra = {}
    if kind == "dmuon":
        extra["transport"] = opt.session.transport
        extra["handoff_seconds"] = opt.stats.get("handoff_seconds", 0.0)
        extra["redone_steps"] = opt.stats.get("redone_steps", 0)
        opt.close()
    return dict(losses=losses, iter_seconds=iters, step_seconds=steps_t,
                total_seconds=time.perf_counter() - t_start, **extra)

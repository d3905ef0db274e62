"""Models, data and an independent reference Muon for the tests.

The reference follows docs/design.md ("The math of a Muon step") literally,
in plain torch fp32:
    M  <- mu * M + (1 - mu) * G
    U  <- nesterov ? (1 - mu) * G + mu * M : M
    O  <- NS(U)      (transpose so rows <= cols; X = U / max(||U||_F, eps);
                      per step A = X X^T; B = b A + c A A; X = a X + B X)
    W  <- W * (1 - lr * wd) - lr * scale(A, B) * O
with scale "original" = sqrt(max(1, A / B)), "match_rms_adamw" =
0.2 * sqrt(max(A, B)). Every other parameter: torch.optim.AdamW.
"""

import math

import torch
from torch import nn

CLASSIC = (3.4445, -4.7750, 2.0315)

# The examples are the spelling users copy: run with this warnings filter
# (pytest's filterwarnings, or PYTHONWARNINGS for a subprocess), a
# DeprecationWarning of dmuon's fails them: a deprecated flat DMuon keyword
# ("DMuon(adamw_lr=...) is deprecated: ..."), dmuon.torch ("dmuon.torch is
# deprecated; ..."). It matches the message (its start, case-insensitively):
# the flat-keyword warning is attributed to DMuon's caller (stacklevel=2),
# so a filter on the module ("...:dmuon") would not see it.
DMUON_DEPRECATIONS_FAIL = "error:dmuon:DeprecationWarning"


def newton_schulz(u, coefficients=CLASSIC, steps=5, eps=1e-7):
    a, b, c = coefficients
    tall = u.shape[0] > u.shape[1]
    x = u.t() if tall else u
    x = x / torch.clamp(x.norm(), min=eps)
    for _ in range(steps):
        am = x @ x.t()
        bm = b * am + c * (am @ am)
        x = a * x + bm @ x
    return x.t() if tall else x


def lr_scale(rows, cols, fn):
    if fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


class ReferenceMuon:
    """Muon on `matrices` (a list of parameters, conv weights flattened) plus
    torch.optim.AdamW on `others`."""

    def __init__(self, matrices, others, lr, weight_decay, momentum=0.95,
                 nesterov=True, adjust_lr_fn=None, adamw_lr=1e-3,
                 adamw_betas=(0.9, 0.999), adamw_eps=1e-8, adamw_wd=0.01):
        self.matrices = list(matrices)
        self.m = [torch.zeros(p.shape[0], p[0].numel()) for p in self.matrices]
        self.lr, self.wd, self.mu, self.nesterov = lr, weight_decay, momentum, nesterov
        self.fn = adjust_lr_fn
        others = list(others)
        self.adamw = torch.optim.AdamW(others, lr=adamw_lr, betas=adamw_betas,
                                       eps=adamw_eps, weight_decay=adamw_wd) if others else None

    @torch.no_grad()
    def step(self):
        mu = self.mu
        for p, m in zip(self.matrices, self.m):
            g = p.grad.reshape(m.shape)
            m.mul_(mu).add_((1 - mu) * g)
            u = (1 - mu) * g + mu * m if self.nesterov else m
            o = newton_schulz(u)
            rows, cols = m.shape
            p.mul_(1 - self.lr * self.wd)
            p.sub_(self.lr * lr_scale(rows, cols, self.fn) * o.reshape(p.shape))
        if self.adamw:
            self.adamw.step()

    def zero_grad(self):
        for p in self.matrices:
            p.grad = None
        if self.adamw:
            self.adamw.zero_grad(set_to_none=True)


class MLP(nn.Module):
    def __init__(self, d_in=24, hidden=48, d_out=10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class TinyLM(nn.Module):
    """A GPT-style language model: embeddings, pre-norm blocks with causal
    self-attention and an MLP, a final norm and an output head.

    activation: the MLP's; "gelu" makes the loss smooth in the weights, so two
    fp32 optimizers that differ by roundings stay that close over many steps
    (with ReLU a unit whose input crosses zero in one run and not the other
    turns a 1e-6 difference into 1e-4 in one step, whatever the optimizer).
    """

    def __init__(self, vocab=32, d=32, heads=2, layers=2, seq=16, activation="relu"):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, activation) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class Block(nn.Module):
    def __init__(self, d, heads, activation="relu"):
        super().__init__()
        self.heads = heads
        self.act = {"relu": torch.relu, "gelu": nn.functional.gelu}[activation]
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(self.act(self.fc(self.ln2(x))))


class ConvNet(nn.Module):
    """Embeddings, norms, biases and a conv layer: for the routing table."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.conv = nn.Conv2d(3, 6, 3)
        self.bn = nn.BatchNorm2d(6)
        self.fc = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)
        self.scale = nn.Parameter(torch.ones(()))


def mlp_batch(step, n=32, d_in=24, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed * 7919 + step)
    return torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g)


def lm_batch(step, n=8, seq=16, vocab=32, seed=0):
    g = torch.Generator().manual_seed(seed * 7919 + step)
    x = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def loss_of(model, batch):
    x, y = batch
    out = model(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def train(model, opt, steps, batch_fn, start=0):
    losses = []
    for s in range(start, start + steps):
        loss = loss_of(model, batch_fn(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def max_rel_err(model_a, model_b):
    pa, pb = dict(model_a.named_parameters()), dict(model_b.named_parameters())
    return max(rel_err(pa[n].detach(), pb[n].detach()) for n in pb)


def muon_split(model, adamw_modules=()):
    """The reference's routing: matrices of >= 2 dims except embeddings and
    the listed modules' parameters go to Muon."""
    skip = {id(p) for m in adamw_modules for p in m.parameters()}
    skip |= {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    mats = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in skip]
    ids = {id(p) for p in mats}
    return mats, [p for p in model.parameters() if id(p) not in ids]


def state_key(opt, sd, param):
    """The key of `param` in state_dict sd["state"] (its position in
    opt.param_groups, as sd["param_groups"] lists it)."""
    for g, saved in zip(opt.param_groups, sd["param_groups"]):
        for p, k in zip(g["params"], saved["params"]):
            if p is param:
                return k
    raise KeyError("not a parameter of this optimizer")


def momentum_by_name(model, opt, sd):
    """{parameter name: its momentum_buffer in sd} of every Muon parameter of
    DMuon opt's state_dict sd (torch.optim.Muon's layout)."""
    muon = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    return {n: sd["state"][state_key(opt, sd, p)]["momentum_buffer"]
            for n, p in model.named_parameters() if id(p) in muon}

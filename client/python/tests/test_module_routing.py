"""Routing by module, as the Muon ecosystem routes: the weights of nn.Linear
and nn.ConvNd (flattened) go to dmuond; cls tokens, learned positional
tables (2-D ones too), embeddings, norms, biases, 3-D+ tensors that are not
conv weights and a head tied to an embedding go to AdamW. A ViT-like model
routed so trains exactly like torch.optim.Muon (fp32 Newton–Schulz) +
torch.optim.AdamW routed the same way; the conv weight is a 2-D parameter
there (torch's Muon takes only 2-D), used as the conv's 4-D weight.
"""

import pytest
import torch
from torch import nn

from dmuon.optim import DMuon
from torch_ref import DM_ADAMW, MUON, ADAMW, assert_same, fp32_muon, pair

pytestmark = pytest.mark.timeout(60)
D, PATCH, IMG, CLASSES = 24, 4, 8, 5
N = (IMG // PATCH) ** 2


class FlatConv(nn.Module):
    """A conv whose weight is stored flattened (out, in*k*k): the reference's
    patch embedding, which torch.optim.Muon accepts."""

    def __init__(self, conv):
        super().__init__()
        self.shape = conv.weight.shape
        self.stride = conv.stride
        self.weight = nn.Parameter(conv.weight.detach().reshape(self.shape[0], -1).clone())
        self.bias = nn.Parameter(conv.bias.detach().clone())

    def forward(self, x):
        return nn.functional.conv2d(x, self.weight.view(self.shape), self.bias, self.stride)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)  # a key bias gets only rounding noise
        self.proj = nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.gate = nn.Parameter(torch.ones(2, 1, D))  # 3-D, not a conv: AdamW

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 2, D // 2).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.gate[0] * self.proj(a.transpose(1, 2).reshape(b, t, D))
        return x + self.gate[1] * self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, D, PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, N + 1, D) * 0.02)
        self.pos_2d = nn.Parameter(torch.randn(N + 1, D) * 0.02)  # 2-D, still AdamW
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1)
        x = x + self.pos_embed + self.pos_2d
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x[:, 0]))


MUON_NAMES = {"patch.weight", "head.weight"} | {
    f"blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "fc1", "fc2")}


def test_vit_routed_by_module_trains_like_torch(monkeypatch, daemon, capsys):
    ref, dm = pair(ViT, seed=1)
    ref.patch = FlatConv(ref.patch)
    mats = [p for n, p in ref.named_parameters() if n in MUON_NAMES]
    others = [p for n, p in ref.named_parameters() if n not in MUON_NAMES]
    muon = fp32_muon(monkeypatch)(mats, **MUON)
    adamw = torch.optim.AdamW(others, **ADAMW)
    opt = DMuon(dm, **MUON, **DM_ADAMW, server=daemon.address)
    routes = {r["name"]: r for r in opt.routing}
    assert {n for n, r in routes.items() if r["route"] == "muon"} == MUON_NAMES
    assert routes["patch.weight"]["matrix"] == (D, 3 * PATCH * PATCH)
    assert "flattened" in routes["patch.weight"]["reason"]
    assert "nn.Parameter" in routes["pos_2d"]["reason"]
    assert "nn.Parameter" in routes["blocks.0.gate"]["reason"]
    # The compact table, once, at construction: a line per group with counts.
    err = capsys.readouterr().err
    assert err.count("DMuon routing") == 1
    assert "group 0 dmuond: 10 tensors" in err and "Conv2d weight 1" in err
    assert "Linear weight 9" in err and "raw nn.Parameter 5" in err
    for step in range(10):
        g = torch.Generator().manual_seed(500 + step)
        img, y = torch.randn(16, 3, IMG, IMG, generator=g), torch.randint(0, CLASSES, (16,),
                                                                          generator=g)
        nn.functional.cross_entropy(ref(img), y).backward()
        muon.step(), adamw.step(), muon.zero_grad(), adamw.zero_grad()
        nn.functional.cross_entropy(dm(img), y).backward()
        opt.step()
        opt.zero_grad()
        assert_same(ref, dm, step)  # patch.weight compared flattened
    opt.close()


class TiedLM(nn.Module):
    def __init__(self, tie):
        super().__init__()
        self.tok = nn.Embedding(20, 8)
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 20, bias=False)
        self.mha = nn.MultiheadAttention(8, 2)
        self.thin = nn.Linear(8, 1)
        self.table = nn.Parameter(torch.zeros(2, 3, 4, 5))
        if tie:
            self.lm_head.weight = self.tok.weight


@pytest.mark.parametrize("tie", [True, False])
def test_output_heads_and_other_modules(daemon, tie):
    model = TiedLM(tie)
    opt = DMuon(model, server=daemon.address, verbose=True)
    routes = {r["name"]: (r["route"], r["reason"]) for r in opt.routing}
    assert routes["tok.weight"][0] == "adamw"
    if tie:  # one parameter, owned by the embedding: AdamW
        assert "lm_head.weight" not in routes and "tied" in routes["tok.weight"][1]
    else:  # an untied head is an nn.Linear: Muon unless adamw= says otherwise
        assert routes["lm_head.weight"] == ("muon", "Linear weight")
    assert routes["mha.in_proj_weight"][0] == "muon"
    assert routes["mha.out_proj.weight"][0] == "muon"
    assert routes["thin.weight"][0] == "adamw"  # 1x8: not a matrix for Muon
    assert routes["table"][0] == "adamw"  # 4-D, not a conv weight
    assert routes["norm.weight"][0] == routes["fc.bias"][0] == "adamw"
    opt.close()
    if not tie:
        opt = DMuon(model, server=daemon.address, adamw=[model.lm_head])
        assert {r["name"]: r["route"] for r in opt.routing}["lm_head.weight"] == "adamw"
        opt.close()

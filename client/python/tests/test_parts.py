"""Structured parameters (dmuon/_parts.py): MoE expert stacks (experts=) and
fused weights split along dim 0 (split=), each part a Muon matrix of its own.

The reference is torch.optim.Muon (fp32 Newton–Schulz, torch_ref.fp32_muon)
over every part as a separate 2-D parameter, fed the part's slice of the
stacked gradient (zeros for an expert that got no tokens: a stacked
parameter's gradient is never None per expert), plus torch.optim.AdamW for
the rest."""

import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":  # a DDP rank (test_ddp_hands_off_each_part): conftest's paths
    sys.path[:0] = [os.path.dirname(HERE), HERE]

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from dmuon.optim import DMuon  # noqa: E402
from helpers import momentum_by_name, rel_err  # noqa: E402
from ranks import launch, worker_args, worker_main  # noqa: E402
from torch_ref import ADAMW, DM_ADAMW, MUON, TOL, fp32_muon  # noqa: E402

E, D, H, T = 6, 16, 32, 5  # experts, model dim, expert hidden dim, tokens
QKV = {"q": 16, "k": 16, "v": 8}  # unequal parts, as grouped-query attention


class Experts(nn.Module):
    """3-D expert stacks; top-1 routed tokens (its own forward, so that
    overlap_forward applies the stacks' updates before it)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, H, D) / D ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, H) / H ** 0.5)

    def forward(self, x, gate, used):
        top = gate.argmax(-1)
        y = torch.zeros_like(x)
        for e in range(E):
            m = top == e
            if m.any():
                used.append(e)
                z = torch.relu(x[m] @ self.w1[e].T) @ self.w2[e].T
                y = y.index_add(0, m.nonzero().squeeze(1), gate[m, e:e + 1] * z)
        return y


class Block(nn.Module):
    """Attention with a fused QKV projection, then a top-1 MoE with 3-D
    expert stacks; with T < E tokens some experts get none in every step."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, sum(QKV.values()), bias=False)  # k.bias: no gradient
        self.out = nn.Linear(QKV["v"], D)
        self.router = nn.Linear(D, E, bias=False)
        self.moe = Experts()
        self.head = nn.Linear(D, 1)
        self.used = []  # per forward: the experts that got tokens

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.qkv(h).split(list(QKV.values()), dim=-1)
        att = torch.softmax(q @ k.T / QKV["q"] ** 0.5, dim=-1)
        x = x + self.out(att @ v)
        gate = torch.softmax(self.router(x), dim=-1)
        self.used.append([])
        y = self.moe(x, gate, self.used[-1])
        return self.head(x + y).square().mean()


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(T, D, generator=g)


class Reference:
    """torch.optim.Muon over every part as its own parameter (each kept in
    step with the model's stacked/fused parameter) + torch.optim.AdamW."""

    def __init__(self, model, muon_cls, **hyper):
        self.model = model
        self.parts = []  # (model parameter, index along dim 0, part parameter)
        for p in (model.moe.w1, model.moe.w2):
            self.parts += [(p, e, nn.Parameter(p.detach()[e].clone())) for e in range(E)]
        at = 0
        for n in QKV.values():
            w = model.qkv.weight
            self.parts.append((w, slice(at, at + n), nn.Parameter(w.detach()[at:at + n].clone())))
            at += n
        stacked = {id(model.moe.w1), id(model.moe.w2), id(model.qkv.weight)}
        mats = [model.out.weight, model.router.weight]
        others = [p for p in model.parameters()
                  if id(p) not in stacked and all(p is not m for m in mats)]
        self.muon = muon_cls(mats + [q for _, _, q in self.parts], **{**MUON, **hyper})
        self.adamw = torch.optim.AdamW(others, **ADAMW)

    @torch.no_grad()
    def step(self):
        for p, i, q in self.parts:
            q.grad = p.grad[i].clone()  # zeros for an expert without tokens
        self.muon.step()
        self.adamw.step()
        for p, i, q in self.parts:
            p[i] = q

    def zero_grad(self):
        self.muon.zero_grad()
        self.adamw.zero_grad()
        self.model.zero_grad()


def make_dmuon(model, daemon, **kw):
    kw.setdefault("experts", [model.moe.w1, "moe.w2"])
    kw.setdefault("split", {"qkv.weight": QKV})
    return DMuon(model, server=daemon.address, adamw=[model.head], **MUON, **DM_ADAMW,
                 **kw)


def train(model, opt, steps, first=0):
    for s in range(first, first + steps):
        model(batch(s)).backward()
        opt.step()
        opt.zero_grad()


def check_same(dm, ref, step):
    """Every matrix (each expert, each part) and every other parameter within
    TOL relative."""
    for name, p in ref.model.named_parameters():
        a, b = dict(dm.named_parameters())[name].detach(), p.detach()
        if name in ("moe.w1", "moe.w2"):
            for e in range(E):
                err = rel_err(a[e], b[e])
                assert err < TOL, f"step {step + 1}, {name}[e{e}]: {err:.2e}"
        elif name == "qkv.weight":
            at = 0
            for label, n in QKV.items():
                err = rel_err(a[at:at + n], b[at:at + n])
                assert err < TOL, f"step {step + 1}, {name}[{label}]: {err:.2e}"
                at += n
        else:
            err = rel_err(a, b)
            assert err < TOL, f"step {step + 1}, {name}: {err:.2e}"


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("overlap", [True, False])
def test_moe_and_qkv_match_torch_muon_per_part(daemon, monkeypatch, overlap, adjust_lr_fn):
    torch.manual_seed(0)
    ref_model = Block()
    dm_model = copy.deepcopy(ref_model)
    ref = Reference(ref_model, fp32_muon(monkeypatch), adjust_lr_fn=adjust_lr_fn)
    opt = make_dmuon(dm_model, daemon, overlap=overlap, adjust_lr_fn=adjust_lr_fn)
    names = opt.session.names
    assert [n for n in names if n.startswith("moe.w1")] == [f"moe.w1[e{e}]" for e in range(E)]
    assert {"qkv.weight[q]", "qkv.weight[k]", "qkv.weight[v]"} <= set(names)
    for s in range(10):
        ref_model(batch(s)).backward()
        ref.step()
        ref.zero_grad()
        dm_model(batch(s)).backward()
        opt.step()
        opt.zero_grad()
        check_same(dm_model, ref, s)
    # Some expert had no tokens in some step (a zero gradient, decayed and
    # updated), and each one had tokens at some step.
    assert any(len(u) < E for u in dm_model.used)
    assert set().union(*dm_model.used) == set(range(E))
    # opt.state[p]["momentum_buffer"]: the full shape, assembled from the parts.
    for p, ref_p in ((dm_model.moe.w1, ref_model.moe.w1), (dm_model.qkv.weight,
                                                           ref_model.qkv.weight)):
        m = opt.state[p]["momentum_buffer"]
        assert m.shape == p.shape
        want = [ref.muon.state[q]["momentum_buffer"] for w, _, q in ref.parts if w is ref_p]
        want = torch.stack(want) if p.dim() == 3 else torch.cat(want)
        assert rel_err(m, want) < TOL
    opt.close()


def test_routing_table_shows_parts(daemon, capsys):
    torch.manual_seed(0)
    model = Block()
    opt = make_dmuon(model, daemon, verbose=True)
    table = capsys.readouterr().out
    assert f"{E} experts of {H} x {D}" in table and f"{E} experts of {D} x {H}" in table
    assert "split into [q] 16 x 16, [k] 16 x 16, [v] 8 x 16" in table
    by_name = {r["name"]: r for r in opt.routing}
    assert by_name["moe.w1"]["route"] == "muon" and by_name["moe.w1"]["matrix"] == (H, D)
    assert by_name["moe.w1"]["handoff"] == "hook"  # each part in backward's hook
    opt.close()
    # Without experts=, a 3-D stack stays with AdamW.
    opt = DMuon(Block(), server=daemon.address)
    assert {r["name"]: r["route"] for r in opt.routing}["moe.w1"] == "adamw"
    opt.close()


def test_experts_auto(daemon):
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Parameter(torch.randn(4, 8, 6))

    model = nn.Sequential(nn.Linear(6, 6))
    model.add_module("mlp", Experts())
    model.add_module("experts", nn.Module())
    model.experts.gate_up = nn.Parameter(torch.randn(4, 12, 6))
    model.table = nn.Parameter(torch.randn(4, 5, 6))  # 3-D, not an expert
    model.experts.conv = nn.Conv1d(6, 6, 3)  # 3-D, a conv weight: flattened
    opt = DMuon(model, server=daemon.address, experts="auto")
    routes = {r["name"]: r for r in opt.routing}
    assert routes["mlp.up"]["route"] == "muon"  # owned by a module named *Expert*
    assert routes["experts.gate_up"]["route"] == "muon"  # "experts" in its name
    assert routes["table"]["route"] == "adamw"
    assert routes["experts.conv.weight"]["matrix"] == (6, 18)
    assert "experts.gate_up[e3]" in opt.session.names
    opt.close()


def test_split_in_equal_parts(daemon, monkeypatch):
    """split={param: n}: n equal parts (per head), vs torch.optim.Muon on
    the n parts as parameters; a bare (name, parameter) list, no model."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(12, 8))
    parts = [nn.Parameter(w.detach()[3 * k:3 * k + 3].clone()) for k in range(4)]
    muon = fp32_muon(monkeypatch)(parts, **MUON)
    opt = DMuon([("w", w)], server=daemon.address, split={w: 4}, **MUON)
    assert opt.session.names == ["w[0]", "w[1]", "w[2]", "w[3]"]
    for s in range(5):
        g = torch.randn(12, 8, generator=torch.Generator().manual_seed(s))
        w.grad = g.clone()
        for k, q in enumerate(parts):
            q.grad = g[3 * k:3 * k + 3].clone()
        opt.step()
        muon.step()
        for k, q in enumerate(parts):
            assert rel_err(w.detach()[3 * k:3 * k + 3], q.detach()) < TOL, (s, k)
    # No gradient: every part skipped (no decay, momentum kept), as torch.
    before, m = w.detach().clone(), opt.state[w]["momentum_buffer"]
    w.grad = None
    opt.step()
    assert torch.equal(w.detach(), before)
    assert torch.equal(opt.state[w]["momentum_buffer"], m)
    opt.close()


def test_bad_split_and_bad_experts_are_refused(daemon):
    model = Block()
    with pytest.raises(ValueError, match=r"qkv\.weight.*\[16, 16\].*40 rows"):
        make_dmuon(model, daemon, split={"qkv.weight": [16, 16]})
    with pytest.raises(ValueError, match=r"qkv\.weight.*40 rows.*3 equal parts"):
        make_dmuon(model, daemon, split={model.qkv.weight: 3})
    with pytest.raises(ValueError, match=r"RoutingOptions\(experts=\) names router\.weight "
                                         r"\[6, 16\].*2-D"):
        make_dmuon(model, daemon, experts=["router.weight"])
    with pytest.raises(ValueError, match=r"RoutingOptions\(experts=\) names .*4-D"):
        DMuon([("w", nn.Parameter(torch.randn(2, 3, 4, 5)))], server=daemon.address,
              experts=["w"])
    with pytest.raises(ValueError, match=r"RoutingOptions\(split=\) names moe\.w1 .*3-D"):
        make_dmuon(model, daemon, experts=[], split={"moe.w1": 2})
    with pytest.raises(ValueError, match=r"both RoutingOptions adamw and experts"):
        DMuon(model, server=daemon.address, adamw=[model.moe.w1], experts=[model.moe.w1])
    with pytest.raises(ValueError,
                       match=r"RoutingOptions\(split=\) names unknown parameter 'nope'"):
        make_dmuon(model, daemon, split={"nope": 2})


def test_state_dict_round_trip(daemon):
    """Save after 4 steps, a new DMuon loads it, 4 more steps == 8 steps
    uninterrupted; torch.optim.Muon's format cannot hold per-part momentum."""
    torch.manual_seed(0)
    model = Block()
    start = copy.deepcopy(model)
    opt = make_dmuon(model, daemon)
    train(model, opt, 8)
    opt.close()

    half = copy.deepcopy(start)
    opt = make_dmuon(half, daemon)
    train(half, opt, 4)
    sd = opt.state_dict()
    # full-shape momentum_buffer per parameter (torch's layout), from its parts'
    st = opt.session.get_state()
    parts = dict(zip(st["names"], st["momentum"]))
    mb = momentum_by_name(half, opt, sd)
    assert tuple(mb["moe.w2"].shape) == (E, D, H) and tuple(mb["qkv.weight"].shape) == (40, D)
    assert torch.equal(mb["moe.w2"][5], torch.from_numpy(parts["moe.w2[e5]"]))
    assert torch.equal(mb["qkv.weight"][QKV["q"] + QKV["k"]:],
                       torch.from_numpy(parts["qkv.weight[v]"]))
    with pytest.raises(NotImplementedError, match=r"qkv\.weight \[40, 16\] is a split weight"):
        opt.to_torch_state_dicts()
    saved = {k: v.detach().clone() for k, v in half.state_dict().items()}
    opt.close()

    # Momentum is elementwise: without split= the weight takes its parts'
    # momentum whole (one Muon matrix from then on).
    other = DMuon(copy.deepcopy(start), server=daemon.address, adamw=["head"],
                  experts=["moe"], **MUON, **DM_ADAMW)
    other.load_state_dict(sd)
    whole = momentum_by_name(other._layout.module, other, other.state_dict())["qkv.weight"]
    assert torch.equal(whole, mb["qkv.weight"])
    other.close()

    resumed = copy.deepcopy(start)
    resumed.load_state_dict(saved)
    opt = make_dmuon(resumed, daemon)
    opt.load_state_dict(sd)
    train(resumed, opt, 4, first=4)
    opt.close()
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_overlap_forward_and_add_param_group(daemon):
    """overlap_forward applies every part before its module's forward; a
    stack added by add_param_group gets its parts (experts= applies)."""
    torch.manual_seed(0)
    base = Block()
    models = [copy.deepcopy(base) for _ in range(3)]
    a = make_dmuon(models[0], daemon)
    b = make_dmuon(models[1], daemon, overlap_forward=True)
    m = models[2]
    first = [p for n, p in m.named_parameters() if n != "moe.w2"]
    c = DMuon(first, model=m, server=daemon.address, adamw=[m.head], **MUON, **DM_ADAMW,
        experts=[m.moe.w1, "moe.w2"], split={"qkv.weight": QKV})
    c.add_param_group({"params": [m.moe.w2]})
    assert [n for n in c.session.names if n.startswith("moe.w2")] == [
        f"moe.w2[e{e}]" for e in range(E)]
    for opt, model in zip((a, b, c), models):
        train(model, opt, 5)
        opt.synchronize()
        opt.close()
    for name, p in models[0].named_parameters():
        assert torch.equal(p, dict(models[1].named_parameters())[name]), name
        assert torch.equal(p, dict(models[2].named_parameters())[name]), name


def test_frozen_stack_unfrozen_later(daemon):
    """A stack frozen at construction is left unchanged (no gradient: every
    part skipped); unfrozen, each part is hooked and trains, equal to
    overlap=False."""
    torch.manual_seed(0)
    base = Block()
    runs = []
    for overlap in (True, False):
        model = copy.deepcopy(base)
        model.moe.w1.requires_grad_(False)
        opt = make_dmuon(model, daemon, overlap=overlap)
        train(model, opt, 2)
        assert torch.equal(model.moe.w1, base.moe.w1)
        model.moe.w1.requires_grad_(True)
        train(model, opt, 3, first=2)
        if overlap:
            assert {r["name"]: r["handoff"] for r in opt.routing}["moe.w1"] == "hook"
        opt.close()
        runs.append(model)
    assert not torch.equal(runs[0].moe.w1, base.moe.w1)
    for (name, a), b in zip(runs[0].named_parameters(), runs[1].parameters()):
        assert torch.equal(a, b), name


# ------------------------------------------------------------ DDP, 2 ranks
DDP_STEPS = 6


def _ddp_dmuon(params, model, server, reduce_in_daemon):
    return DMuon(params, server=server, adamw=[model.head], **MUON, **DM_ADAMW,
                 experts=[model.moe.w1, "moe.w2"], split={"qkv.weight": QKV},
                 reduce_in_daemon=reduce_in_daemon)


def _ddp_rank(args):
    """One rank (ranks.worker_main): DDP over Block, DMuon over the DDP model
    (every part handed off from DDP's comm hook: after the all-reduce, or
    unreduced at once)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = Block()
    ddp = DDP(model)
    opt = _ddp_dmuon(ddp, model, args.server, args.mode == "reduce_in_daemon")
    handoff = {r["name"]: r["handoff"] for r in opt.routing}
    for s in range(DDP_STEPS):
        ddp(batch(args.world * s + args.rank)).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    return {"handoff": handoff,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("mode", ["ddp", "reduce_in_daemon"])
def test_ddp_hands_off_each_part(daemon, tmp_path, mode):
    """2 ranks under DDP == one process on both ranks' batches (the mean
    loss), every part handed off by DDP's comm hook."""
    results, _ = launch("test_parts.py", mode, 2, daemon.address, tmp_path, timeout=180)
    torch.manual_seed(0)
    model = Block()
    opt = _ddp_dmuon(model, model, daemon.address, False)
    for s in range(DDP_STEPS):
        ((model(batch(2 * s)) + model(batch(2 * s + 1))) / 2).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    for rank, got in enumerate(results):
        assert got["handoff"]["moe.w1"] == "ddp" and got["handoff"]["qkv.weight"] == "ddp"
        for name, want in model.named_parameters():
            a, b = got["params"][name], want.detach()
            rows = [a[e] for e in range(E)] if a.dim() == 3 else [a]
            wants = [b[e] for e in range(E)] if b.dim() == 3 else [b]
            for k, (x, y) in enumerate(zip(rows, wants)):
                assert rel_err(x, y) < TOL, (rank, name, k)


if __name__ == "__main__":
    worker_main(worker_args().parse_args(), _ddp_rank)

"""DMuon with torch.distributed.checkpoint (DCP): get/set_optimizer_state_dict
and dcp.save/load, saved on 4 ranks and loaded on 2 (gloo, DDP), FSDP2 on 2
and 4, FSDP2 x TP on 4 into FSDP2 on 2, flatten_optimizer_state_dict, and
the zero-gradient step of DCP's _init_optim_state (dmuon/_dcp.py)."""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, _init_optim_state, get_optimizer_state_dict,
    set_optimizer_state_dict)

from dmuon.optim import DMuon
from helpers import TinyLM, lm_batch, loss_of, muon_split, rel_err, state_key
from ranks import launch
from torch_ref import fp32_muon, muon_adamw_run

HYPER = dict(lr=0.02, weight_decay=0.1, adamw_lr=3e-3)


def run_job(mode, world, address, tmp_path, *extra):
    return launch("dcp_worker.py", mode, world, address, tmp_path,
                  extra=(f"--ckpt={tmp_path / 'ckpt'}", *extra))[0]


def save_then_load(save, load, daemon, tmp_path, *load_extra):
    """save = (mode, world) trains 3 steps and saves with DCP; load = (mode,
    world) loads and trains 3 more. Checks each rank's step counts and that
    dmuond's momentum after the load is the saved one, bit for bit; returns
    (the saving ranks' dicts, the loading ranks')."""
    saved = run_job(save[0], save[1], daemon.address, tmp_path, "--start=0", "--steps=3")
    for r in saved:
        assert r["completed"] == {"saved": 3, "end": 3}, r["completed"]
    loaded = run_job(load[0], load[1], daemon.address, tmp_path, "--start=3", "--steps=3",
                     *load_extra)
    want = saved[0]["momentum"]
    for rank, r in enumerate(loaded):
        assert r["completed"] == {"fresh": 0, "loaded": 3, "end": 6}, (rank, r["completed"])
        assert set(r["loaded_momentum"]) == set(want), rank
        for name, m in want.items():
            assert torch.equal(r["loaded_momentum"][name], m), (rank, name)
    return saved, loaded


def train(model, opt, start, steps):
    for s in range(start, start + steps):
        loss_of(model, lm_batch(s)).backward()
        opt.step()
        opt.zero_grad()


def test_save_on_4_ranks_load_on_2(daemon, tmp_path):
    """DDP on 4 ranks trains 3 steps and saves with DCP; a 2-rank job loads
    it and trains 3 more: the uninterrupted single-process 6-step run, and
    the momentum loaded is the momentum saved, bit for bit."""
    saved, loaded = save_then_load(("save", 4), ("load", 2), daemon, tmp_path, "--seed=1")
    layout = saved[0]["layout"]
    assert layout["momentum_buffer"] == ("Tensor", (96, 32), torch.float32, "None"), layout
    assert set(layout) == {"momentum_buffer", "step"}, layout

    torch.manual_seed(0)
    model = TinyLM()
    opt = DMuon(model, server=daemon.address, adamw=[model.head], **HYPER)
    train(model, opt, 0, 6)
    opt.close()
    for rank, r in enumerate(loaded):
        for name, p in model.named_parameters():
            assert rel_err(r["params"][name], p.detach()) < 1e-5, (rank, name)


def test_init_optim_state_is_not_a_daemon_step(daemon, monkeypatch):
    """DCP's _init_optim_state (zero gradients, lr 0, step()) on a fresh
    DMuon: torch skips it (DMuon's state has its Muon entries); called as
    it would be, dmuond's step count and momentum do not move, AdamW's state
    is made as torch's, and the training after it is torch.optim.Muon +
    AdamW's after the same call."""
    muon_cls = fp32_muon(monkeypatch)
    torch.manual_seed(0)
    model, ref = TinyLM(activation="gelu"), TinyLM(activation="gelu")
    ref.load_state_dict(model.state_dict())
    opt = DMuon(model, server=daemon.address, adamw=[model.head], **HYPER)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    _init_optim_state(opt)
    osd = get_optimizer_state_dict(model, opt)  # single process: no dist needed
    assert opt.session.get_state()["completed_steps"] == 0
    assert opt.stats["steps"] == 0
    # complete as dcp.load's destination: every parameter has its entry
    assert set(osd["state"]) == {n for n, _ in model.named_parameters()}
    assert torch.equal(osd["state"]["head.weight"]["exp_avg"],
                       torch.zeros_like(model.head.weight))

    # the zero step itself, as _init_optim_state makes it
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    st = opt.session.get_state()
    assert st["completed_steps"] == 0 and opt.session.step == 1
    assert all(not m.any() for m in st["momentum"])
    assert int(opt.state[model.head.weight]["step"]) == 1  # AdamW's, as torch's
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n

    mats, others = muon_split(ref, [ref.head])
    refs = [muon_cls(mats, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"]),
            torch.optim.AdamW(others, lr=HYPER["adamw_lr"])]
    for o in refs:
        _init_optim_state(o)  # torch's own: a real zero step
    for s in range(2):
        for m, opts in ((model, [opt]), (ref, refs)):
            loss_of(m, lm_batch(s)).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    assert opt.session.get_state()["completed_steps"] == 2
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.detach(), q.detach()) < 1e-5, n
    opt.close()


def daemon_momentum(opt):
    """dmuond's momentum by table name."""
    st = opt.session.get_state()
    return {n: torch.from_numpy(m).clone() for n, m in zip(st["names"], st["momentum"])}


def assert_same_state(got, want):
    """Two DMuon state_dicts hold equal state (tensors bit for bit)."""
    assert got.get("dmuon") == want.get("dmuon")
    assert got["state"].keys() == want["state"].keys()
    for k, v in want["state"].items():
        assert got["state"][k].keys() == v.keys(), k
        for key, t in v.items():
            assert torch.equal(got["state"][k][key], t), (k, key)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_layouts_one_process(daemon, tmp_path):
    """opt.state_dict() and DCP's get_optimizer_state_dict have one layout
    (torch.optim.Muon + AdamW's: momentum as state[k]["momentum_buffer"]);
    saved and loaded by dcp in one process it restores the momentum exactly,
    and a torch-layout state_dict (no "dmuon" entry) loads through
    load_state_dict too."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = DMuon(model, server=daemon.address, adamw=[model.head], **HYPER)
    train(model, opt, 0, 2)
    mine = opt.state_dict()
    want = daemon_momentum(opt)
    assert mine["dmuon"] == {"format": 2, "completed_steps": 2}
    osd = get_optimizer_state_dict(model, opt)
    assert "dmuon" not in osd  # DCP keeps "state" and "param_groups"
    for name, p in model.named_parameters():  # the same, keyed by FQN
        v = mine["state"][state_key(opt, mine, p)]
        assert osd["state"][name].keys() == v.keys(), name
        for key, t in v.items():
            assert torch.equal(osd["state"][name][key], t), (name, key)
    qkv = osd["state"]["blocks.0.qkv.weight"]
    assert qkv["momentum_buffer"].dtype == torch.float32
    assert torch.equal(qkv["momentum_buffer"], want["blocks.0.qkv.weight"])
    assert float(qkv["step"]) == 2.0
    dcp.save({"optim": osd}, checkpoint_id=str(tmp_path / "one"), no_dist=True)

    model2 = TinyLM()
    model2.load_state_dict(model.state_dict())
    opt2 = DMuon(model2, server=daemon.address, adamw=[model2.head], **HYPER)
    dest = {"optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(dest, checkpoint_id=str(tmp_path / "one"), no_dist=True)
    set_optimizer_state_dict(model2, opt2, dest["optim"])
    assert_same_state(opt2.state_dict(), mine)
    assert list(opt2.state[model2.blocks[0].qkv.weight]) == ["momentum_buffer", "step"]

    # a torch-layout state_dict (int keys, no "dmuon") straight into
    # load_state_dict: torch.optim.Muon's (no "step"; an absent
    # momentum_buffer is zero)
    fc = state_key(opt, mine, model.blocks[1].fc.weight)
    qkv_key = state_key(opt, mine, model.blocks[0].qkv.weight)
    muon_keys = {k for g in mine["param_groups"] if g["use_muon"] for k in g["params"]}
    torch_sd = {"param_groups": mine["param_groups"],
                "state": {k: {n: t for n, t in v.items() if k not in muon_keys or n != "step"}
                          for k, v in mine["state"].items() if k != qkv_key}}
    torch_sd["state"][fc]["momentum_buffer"] = mine["state"][fc]["momentum_buffer"] * 2
    opt3 = DMuon(TinyLM(), server=daemon.address, adamw=["head"], **HYPER)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # not "momentum from zero"
        opt3.load_state_dict(torch_sd)
    got = daemon_momentum(opt3)
    assert torch.equal(got["blocks.1.fc.weight"], want["blocks.1.fc.weight"] * 2)
    assert not got["blocks.0.qkv.weight"].any()  # absent: zero, as torch
    assert opt3.state_dict()["dmuon"]["completed_steps"] == 2  # AdamW's step count

    # the optimizer itself as a DCP Stateful (dcp calls state_dict() and
    # load_state_dict() on it; "dmuon" travels too)
    dcp.save({"optim": opt}, checkpoint_id=str(tmp_path / "stateful"), no_dist=True)
    model4 = TinyLM()
    opt4 = DMuon(model4, server=daemon.address, adamw=[model4.head], **HYPER)
    dcp.load({"optim": opt4}, checkpoint_id=str(tmp_path / "stateful"), no_dist=True)
    assert_same_state(opt4.state_dict(), mine)
    for o in (opt, opt2, opt3, opt4):
        o.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_flatten_optimizer_state_dict(daemon, tmp_path):
    """StateDictOptions(flatten_optimizer_state_dict=True): torch rebuilds
    each parameter's state on load from the keys opt.state[p] lists, and a
    Muon parameter's lists "momentum_buffer" and "step": saved flat on one
    DMuon and loaded into a fresh one, Muon momentum, step count and AdamW's
    state come back exactly, and training goes on as if uninterrupted."""
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    torch.manual_seed(0)
    model = TinyLM()
    opt = DMuon(model, server=daemon.address, adamw=[model.head], **HYPER)
    train(model, opt, 0, 2)
    mine = opt.state_dict()
    osd = get_optimizer_state_dict(model, opt, options=flat)
    assert torch.equal(osd["state.blocks.0.qkv.weight.momentum_buffer"],
                       daemon_momentum(opt)["blocks.0.qkv.weight"])
    assert float(osd["state.blocks.0.qkv.weight.step"]) == 2.0
    dcp.save({"optim": osd}, checkpoint_id=str(tmp_path / "flat"), no_dist=True)

    model2 = TinyLM()
    model2.load_state_dict(model.state_dict())
    opt2 = DMuon(model2, server=daemon.address, adamw=[model2.head], **HYPER)
    dest = {"optim": get_optimizer_state_dict(model2, opt2, options=flat)}
    dcp.load(dest, checkpoint_id=str(tmp_path / "flat"), no_dist=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # not "momentum from zero"
        set_optimizer_state_dict(model2, opt2, dest["optim"], options=flat)
    assert_same_state(opt2.state_dict(), mine)
    assert opt2.session.step == 3
    train(model, opt, 2, 2)
    train(model2, opt2, 2, 2)
    for (n, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), n
    opt.close()
    opt2.close()


def test_fsdp2_save_on_2_ranks_load_on_4(daemon, tmp_path):
    """FSDP2 (DTensor parameters, Shard(0)): momentum_buffer is a DTensor
    laid out as its parameter; saved on 2 ranks, loaded on 4 (5 rows: 3 + 2,
    then 2 + 2 + 1 + 0; a 1-row matrix on one rank), equal to one process's
    uninterrupted run and the momentum bit for bit."""
    pytest.importorskip("torch.distributed.fsdp")
    import fsdp_worker

    saved, loaded = save_then_load(("fsdp_save", 2), ("fsdp_load", 4), daemon, tmp_path)
    layout = saved[0]["layout"]
    assert layout["momentum_buffer"][:3] == ("DTensor", (5, 6), torch.float32), layout
    assert "Shard(dim=0)" in layout["momentum_buffer"][3], layout

    model = fsdp_worker.make_model()
    opt = DMuon(model, server=daemon.address, muon=["4.weight"], **fsdp_worker.HYPER)
    for s in range(6):
        x, y = fsdp_worker.batch(s)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    for rank, r in enumerate(loaded):
        for name, p in model.named_parameters():
            assert rel_err(r["params"][name], p.detach()) < 1e-5, (rank, name)


def fsdp_grads(model, s):
    """fsdp_worker's loss on the whole batch of step s, backward."""
    import fsdp_worker

    x, y = fsdp_worker.batch(s)
    ((model(x) - y) ** 2).mean().backward()


def test_fsdp2_x_tp_on_4_ranks_load_into_fsdp2_on_2(daemon, tmp_path):
    """FSDP2 x TP on a (dp=2, tp=2) mesh of 4 ranks (fc1's weight
    (_StridedShard(dim=0, sf=2), Shard(0)): rows 2 + 1 + 1 + 1, not in rank
    order; fc2's (Shard(0), Shard(1)); the 1x8 head's (Shard(0), Shard(1)),
    all Muon) trains 3 steps and saves with DCP; plain FSDP2 on 2 ranks
    (Shard(0): rows 3 + 2) loads it and trains 3 more. The momentum at the
    switch is the saved one bit for bit (DCP copies each element from the
    saving rank that held it), and every parameter after step 6 is
    torch.optim.Muon (fp32 Newton-Schulz) + AdamW's uninterrupted 6 steps in
    one process, to 1e-5 relative."""
    pytest.importorskip("torch.distributed.fsdp")
    import fsdp_worker

    saved, loaded = save_then_load(("fsdp_tp_save", 4), ("fsdp_load", 2), daemon, tmp_path)
    layout = saved[0]["layout"]
    assert layout["momentum_buffer"] == (
        "DTensor", (5, 6), torch.float32, "(_StridedShard(dim=0, sf=2), Shard(dim=0))"), layout

    muon_names = ("0.weight", "2.weight", "4.weight")
    params, _, momenta = muon_adamw_run(fsdp_worker.make_model(), muon_names, 6, fsdp_grads)
    assert set(saved[0]["momentum"]) == set(muon_names)
    for name, m in saved[0]["momentum"].items():  # dmuond's at the switch: torch's
        assert rel_err(m, momenta[2][name]) < 1e-5, name
    for rank, r in enumerate(loaded):
        for name, p in params[-1].items():
            err = rel_err(r["params"][name], p)
            assert err < 1e-5, f"rank {rank} {name}: {err:.2e}"


@pytest.mark.parametrize("save,load", [(("fsdp_tp_save", 4), ("fsdp_load", 2)),
                                       (("save", 2), ("load", 1))],
                         ids=["fsdp_tp-4-to-fsdp-2", "ddp-2-to-1"])
def test_reference_checkpoint_resumed_at_another_world_size(daemon, tmp_path, save, load):
    """checkpoint_momentum="reference" (issue 28 part 2): the saving job's DCP
    checkpoint of step 3 holds no momentum (dmuond's mark of step 3 is it),
    the job goes on to step 5 and is lost; a job of another world size and
    sharding (FSDP2 x TP on 4 ranks -> FSDP2 on 2; DDP on 2 -> 1) opens it
    with resume=3, loads the checkpoint and trains 3 more steps: dmuond's
    momentum after the load is the one saved, bit for bit, and the run is
    the uninterrupted one (FSDP2: torch.optim.Muon fp32 + AdamW to 1e-5;
    DDP: one process's DMuon, as test_save_on_4_ranks_load_on_2)."""
    pytest.importorskip("torch.distributed.fsdp")
    ref = ("--reference", f"--job=dcp-ref-{save[0]}")
    saved = run_job(save[0], save[1], daemon.address, tmp_path, "--start=0", "--steps=3",
                    "--past=2", *ref)
    assert "momentum_buffer" not in saved[0]["layout"], saved[0]["layout"]
    assert saved[0]["completed"] == {"saved": 3, "end": 5}, saved[0]["completed"]
    loaded = run_job(load[0], load[1], daemon.address, tmp_path, "--start=3", "--steps=3",
                     "--seed=1", *ref)
    for rank, r in enumerate(loaded):
        assert r["completed"] == {"fresh": 3, "loaded": 3, "end": 6}, (rank, r["completed"])
        for name, m in saved[0]["momentum"].items():
            assert torch.equal(r["loaded_momentum"][name], m), (rank, name)
    if save[0] == "save":
        torch.manual_seed(0)
        model = TinyLM()
        opt = DMuon(model, server=daemon.address, adamw=[model.head], **HYPER)
        train(model, opt, 0, 6)
        opt.close()
        want = {n: p.detach() for n, p in model.named_parameters()}
    else:
        import fsdp_worker

        want = muon_adamw_run(fsdp_worker.make_model(), ("0.weight", "2.weight", "4.weight"),
                              6, fsdp_grads)[0][-1]
    for rank, r in enumerate(loaded):
        for name, p in want.items():
            assert rel_err(r["params"][name], p) < 1e-5, (rank, name)


def test_parts_round_trip(daemon):
    """A fused weight orthogonalized as parts (split=): its momentum_buffer is
    the full-shape tensor of its parts' momentum, and set_optimizer_state_dict
    gives each part its own back, exactly."""
    torch.manual_seed(0)
    model = TinyLM()
    split = {"blocks.0.qkv.weight": 3}
    opt = DMuon(model, server=daemon.address, adamw=[model.head], split=split, **HYPER)
    train(model, opt, 0, 2)
    mine = daemon_momentum(opt)
    osd = get_optimizer_state_dict(model, opt)
    mb = osd["state"]["blocks.0.qkv.weight"]["momentum_buffer"]
    assert tuple(mb.shape) == (96, 32)
    assert torch.equal(mb[32:64], mine["blocks.0.qkv.weight[1]"])

    model2 = TinyLM()
    opt2 = DMuon(model2, server=daemon.address, adamw=[model2.head], split=split, **HYPER)
    set_optimizer_state_dict(model2, opt2, osd)
    got = daemon_momentum(opt2)
    assert opt2.session.get_state()["completed_steps"] == 2 and set(got) == set(mine)
    for name, m in mine.items():
        assert torch.equal(got[name], m), name
    opt.close()
    opt2.close()

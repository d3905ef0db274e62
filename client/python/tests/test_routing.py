"""Which parameter goes where, and the table that says so."""

import pytest

import dmuon
from dmuon import _routing
from dmuon.optim import DMuon
from helpers import ConvNet, TinyLM


def test_routing_table_for_embeddings_norms_biases_and_conv(daemon, capsys):
    model = ConvNet()
    opt = DMuon(model, server=daemon.address, adamw=[model.head], verbose=True)
    got = {r["name"]: (r["route"], r["matrix"]) for r in opt.routing}
    assert got == {
        "embed.weight": ("adamw", None),
        "conv.weight": ("muon", (6, 27)),
        "conv.bias": ("adamw", None),
        "bn.weight": ("adamw", None),
        "bn.bias": ("adamw", None),
        "fc.weight": ("muon", (16, 8)),
        "fc.bias": ("adamw", None),
        "ln.weight": ("adamw", None),
        "ln.bias": ("adamw", None),
        "head.weight": ("adamw", None),
        "head.bias": ("adamw", None),
        "scale": ("adamw", None),
    }
    reasons = {r["name"]: r["reason"] for r in opt.routing}
    assert reasons["embed.weight"] == "embedding"
    assert reasons["head.weight"] == "adamw= (user)"
    assert "flattened to 6x27" in reasons["conv.weight"]
    printed = capsys.readouterr().out
    assert printed == opt.routing_table + "\n"
    assert "2 of 12 parameters" in printed and "conv.weight" in printed
    # The job's (random) id, so that a trainer can reopen its momentum.
    assert opt.job_id and f"job on dmuond: '{opt.job_id}'" in printed
    # The groups: Muon's carry torch.optim.Muon's keys, AdamW's its own.
    muon_g = [g for g in opt.param_groups if g["use_muon"]]
    adam_g = [g for g in opt.param_groups if not g["use_muon"]]
    assert len(muon_g) == 1 and len(muon_g[0]["params"]) == 2
    assert muon_g[0]["ns_coefficients"] == (3.4445, -4.775, 2.0315)
    assert adam_g[0]["betas"] == (0.9, 0.999) and len(adam_g[0]["params"]) == 10
    opt.close()


def test_explicit_routes_by_name_module_and_group(daemon):
    model = ConvNet()
    opt = DMuon(
        [{"params": [model.fc.weight, model.conv.weight], "lr": 0.05},
         {"params": [model.embed.weight], "use_muon": True},
         {"params": [p for n, p in model.named_parameters()
                     if n not in ("fc.weight", "conv.weight", "embed.weight")],
          "adamw_lr": 1e-4}],
        model=model, server=daemon.address, adamw=["fc"], muon=[model.head.weight])
    routes = {r["name"]: r["route"] for r in opt.routing}
    assert routes["fc.weight"] == "adamw"  # adamw=["fc"] wins
    assert routes["embed.weight"] == "muon"  # its group said use_muon
    assert routes["head.weight"] == "muon"  # muon= (user)
    lrs = sorted((g["use_muon"], g["lr"]) for g in opt.param_groups)
    assert lrs == [(False, 0.0001), (False, 0.001), (True, 0.001), (True, 0.001),
                   (True, 0.05)]
    opt.close()


def test_parameters_without_a_model_and_named_parameters(daemon):
    model = ConvNet()
    opt = DMuon(model.parameters(), server=daemon.address)
    routes = opt.routing  # scale, embed.weight, conv.weight, ...
    assert routes[1]["name"] == "params[0][1]" and routes[1]["route"] == "muon"
    assert "embeddings not detectable" in routes[1]["reason"]
    opt.close()
    opt = DMuon(model.named_parameters(), server=daemon.address)
    assert opt.routing[2]["name"] == "conv.weight"
    opt.close()


def test_routing_errors(daemon):
    model = ConvNet()
    with pytest.raises(ValueError, match=r"fc.bias \[16\] was routed to Muon but is 1-D"):
        DMuon(model, server=daemon.address, muon=["fc.bias"])
    with pytest.raises(ValueError, match="names no parameter"):
        DMuon(model, server=daemon.address, adamw=["nope"])
    with pytest.raises(ValueError, match="unknown parameter-group keys"):
        DMuon([{"params": model.parameters(), "betas": (0.9, 0.9)}],
              server=daemon.address)


def test_frozen_parameters_keep_their_modules_route(daemon):
    """Frozen at construction: routed by its module (so unfreezing it later
    trains it on that route), shown as frozen, handed over in step() until it
    is unfrozen."""
    model = ConvNet()
    model.fc.weight.requires_grad_(False)
    model.ln.weight.requires_grad_(False)
    opt = DMuon(model, server=daemon.address)
    route = {r["name"]: (r["route"], r["handoff"]) for r in opt.routing}
    assert route["fc.weight"] == ("muon", "step (frozen)")
    assert route["ln.weight"] == ("adamw", None)
    assert "frozen at construction" in opt.routing_table
    assert opt.session.names == ["conv.weight", "fc.weight", "head.weight"]
    opt.close()


def test_layer_is_the_enclosing_repeated_block():
    key = _routing.layer_key
    assert key("blocks.3.attn.qkv.weight") == "blocks.3"
    assert key("model.layers.17.mlp.up_proj.weight") == "model.layers.17"
    assert key("module.model.layers.2.mlp.experts.5.w1.weight") == "module.model.layers.2"
    assert key("0.weight") == "0"  # nn.Sequential
    # No numeric component: the module enclosing the parameter's module.
    assert key("encoder.attn.q.weight") == "encoder.attn"
    assert key("fc1.weight") == ""  # the model itself
    # The model's own parameters and unnamed ones have no layer.
    assert key("scale") is None and key("params[0][1]") is None
    assert key("blocks.x3.weight") == "blocks"  # "x3" is not a number
    # Numbered in first-appearance order; None stays None.
    names = ["layers.1.q.weight", "layers.0.q.weight", "layers.1.k.weight",
             "fc.weight", "w", "head.weight", "layers.10.q.weight"]
    assert _routing.layer_ids(names) == [0, 1, 0, 2, None, 2, 3]


def test_dmuon_sends_each_matrix_with_its_block_as_layer(daemon):
    model = TinyLM(layers=3)
    opt = DMuon(model, server=daemon.address, adamw=[model.head])
    layers = {r["name"]: r["layer"] for r in opt.routing if r["route"] == "muon"}
    assert layers == {f"blocks.{b}.{m}.weight": b for b in range(3)
                      for m in ("qkv", "proj", "fc", "out")}
    assert all(r["layer"] is None for r in opt.routing if r["route"] != "muon")
    opt.close()
    # Without names (no model=), no layers; the daemon takes the table alike.
    opt = DMuon(list(ConvNet().parameters()), server=daemon.address)
    muon = [r["layer"] for r in opt.routing if r["route"] == "muon"]
    assert muon and all(layer is None for layer in muon)
    opt.close()


def test_client_tables_carry_layers_and_ranks_must_agree(daemon):
    client = dmuon.Client(daemon.address, deadline=5.0)
    params = [dict(name="blocks.0.q", rows=4, cols=4, layer=0),
              dict(name="head", rows=4, cols=4, layer=None)]
    s0 = client.open_session("layers", params, rank=0, world_size=2)
    other = [dict(p) for p in params]
    other[0]["layer"] = 1
    with pytest.raises(ValueError,
                       match=r"'blocks.0.q' layer 1 does not match rank 0's 0"):
        client.open_session("layers", other, rank=1, world_size=2)
    s0.close()


def test_the_summary_names_the_job(daemon, capsys):
    """The default one-line summary shows where the Muon half went and the
    job's id (random by default: without it a trainer cannot reopen it)."""
    model = ConvNet()
    opt = DMuon(model, lr=0.02, daemon_options=dmuon.DaemonOptions(server=daemon.address))
    err = capsys.readouterr().err
    assert f"-> dmuond at {daemon.address}" in err and f"job '{opt.job_id}'" in err, err
    opt.close()

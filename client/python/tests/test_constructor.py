"""DMuon's constructor: its parameters are torch.optim.Muon's positional
ones, then grouped options; params are checked as torch.optim.Optimizer
checks them (torch's exception types and messages); each flat keyword still
works, with a DeprecationWarning naming its new spelling; the package ships
py.typed and type stubs of its extension."""

import inspect
import pathlib
import sys
import warnings

import pytest
import torch
from torch import nn

import dmuon
from dmuon import AdamWOptions, DaemonOptions, OverlapOptions, RoutingOptions
from dmuon.optim import DMuon

pytestmark = pytest.mark.timeout(120)

UNREACHABLE = DaemonOptions("127.0.0.1:1", timeout=0.5)  # refused before any connect


def _raised(make):
    """The exception make() raises (pytest.fail if none)."""
    with pytest.raises(Exception) as info:
        make()
    return info.value


def _same_error(torch_make, dmuon_make):
    theirs, mine = _raised(torch_make), _raised(dmuon_make)
    assert type(mine) is type(theirs) and str(mine) == str(theirs), (theirs, mine)


def test_signature_is_torch_muons_then_the_option_groups():
    ours = inspect.signature(DMuon.__init__).parameters
    torch_muon = inspect.signature(torch.optim.Muon.__init__).parameters
    positional = [n for n, p in ours.items()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == list(torch_muon)
    for name in positional[1:]:  # params has no default
        assert ours[name].default == torch_muon[name].default or name == "ns_coefficients"
    keyword = [n for n, p in ours.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword == ["use_addmm", "method", "adamw_options", "daemon_options",
                       "routing_options", "overlap_options", "process_group", "verbose",
                       "strict"]
    assert len(ours) <= 20
    lines, _ = inspect.getsourcelines(DMuon.__init__)
    assert len(lines) < 60


def test_a_complex_muon_parameter_raises_as_torch_muon():
    """torch.optim.Muon raises for a complex parameter (at step(), where it
    first reads it); DMuon raises the same error type at construction, where
    it builds dmuond's (real) table, instead of dropping the imaginary part."""
    w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    w.grad = torch.randn_like(w)
    theirs = _raised(lambda: torch.optim.Muon([w]).step())
    assert "complex" in str(theirs)
    mine = _raised(lambda: DMuon([w], daemon_options=UNREACHABLE))
    assert type(mine) is type(theirs)
    assert str(theirs) in str(mine) and "AdamW" in str(mine)


def test_a_complex_adamw_parameter_steps_as_torch_adamw():
    """AdamW takes complex parameters (torch.optim.AdamW views them as
    real): routed there, they step exactly as torch's."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(5, dtype=torch.complex64))
    b = nn.Parameter(a.detach().clone())
    ref = torch.optim.AdamW([a], lr=1e-2)
    opt = DMuon([b], adamw_options=AdamWOptions(lr=1e-2))
    assert opt.session is None  # no Muon matrix: no dmuond
    for _ in range(3):
        for p, o in ((a, ref), (b, opt)):
            p.grad = torch.full_like(p, 0.5 + 0.25j)
            o.step()
    assert torch.equal(a, b)


def test_a_set_of_parameters_warns_as_torch():
    """A set's order differs between processes, and so between ranks:
    torch warns (FutureWarning), and so does DMuon."""
    params = {torch.zeros(3, requires_grad=True), torch.zeros(4, requires_grad=True)}
    with pytest.warns(FutureWarning, match="ordered collections") as theirs:
        torch.optim.AdamW(params)
    with pytest.warns(FutureWarning, match="ordered collections") as mine:
        DMuon(params)
    assert [str(w.message) for w in mine if w.category is FutureWarning] == [
        str(w.message) for w in theirs if w.category is FutureWarning]
    assert any(w.filename == __file__ for w in mine)  # points at the caller
    group = [{"params": {torch.zeros(3, requires_grad=True)}}]
    _same_error(lambda: torch.optim.AdamW(group), lambda: DMuon(group))


def test_not_an_iterable_of_parameters_is_torchs_type_error():
    w = nn.Parameter(torch.randn(4, 4))
    _same_error(lambda: torch.optim.Muon(w), lambda: DMuon(w, daemon_options=UNREACHABLE))
    _same_error(lambda: torch.optim.Muon(5), lambda: DMuon(5))
    _same_error(lambda: torch.optim.Muon([w, 5]),
                lambda: DMuon([w, 5], daemon_options=UNREACHABLE))
    _same_error(lambda: torch.optim.Muon([]), lambda: DMuon([]))


def test_named_and_unnamed_parameters_mixed_is_torchs_value_error():
    w, v = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(3, 4))
    # New dicts for each call: torch's add_param_group rewrites the ones it gets.
    for params in (lambda: [("w", w), v],
                   lambda: [{"params": [("w", w)]}, {"params": [v]}],
                   lambda: [{"params": [w]}, {"params": [("v", v)]}]):
        _same_error(lambda: torch.optim.Muon(params()),
                    lambda: DMuon(params(), daemon_options=UNREACHABLE))


def test_add_param_group_checks_as_torch():
    b, c = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    opt = DMuon([b])  # AdamW only: no dmuond
    ref = torch.optim.AdamW([b])
    _same_error(lambda: ref.add_param_group({"params": [("c", c)]}),
                lambda: opt.add_param_group({"params": [("c", c)]}))
    _same_error(lambda: ref.add_param_group([c]), lambda: opt.add_param_group([c]))


def test_named_parameters_in_groups_name_the_routes():
    b, c = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    opt = DMuon([{"params": [("bias", b)]}, {"params": [("scale", c)], "adamw_lr": 0.1}])
    assert [r["name"] for r in opt.routing] == ["bias", "scale"]
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 0.1]


# Each flat keyword: (its value, the other flat keywords the call needs, a
# check that the optimizer took the value: check(opt, m), m.daemon the
# daemon's address, m.routes {name: opt.routing's entry}).
def _adamw(key, value):
    return lambda opt, m: next(g for g in opt.param_groups if not g["use_muon"])[key] == value


FLAT = {
    "adamw_lr": (3e-3, {}, _adamw("lr", 3e-3)),
    "adamw_betas": ((0.8, 0.9), {}, _adamw("betas", (0.8, 0.9))),
    "adamw_eps": (1e-6, {}, _adamw("eps", 1e-6)),
    "adamw_wd": (0.5, {}, _adamw("weight_decay", 0.5)),
    "server": ("DAEMON", {}, lambda opt, m: opt.address == m.daemon),
    "transport": ("inline", {"server": "DAEMON"}, lambda opt, m: opt.transport == "inline"),
    "timeout": (7.0, {"server": "DAEMON"},
                lambda opt, m: opt._handoff.link.timeout == 7.0),
    "job_id": ("flat-job", {"server": "DAEMON"}, lambda opt, m: opt.job_id == "flat-job"),
    "resume": ("replace", {"server": "DAEMON", "job_id": "flat-resume"},
               lambda opt, m: opt._handoff.recovery.resume == "replace"),
    "daemon_flags": (["--cpu-threads=1"], {},
                     lambda opt, m: "--cpu-threads=1" in opt._handoff.link.daemon.process.args),
    "model": ("MODEL", {"server": "DAEMON"},
              lambda opt, m: m.routes["fc.weight"]["reason"] == "Linear weight"),
    "adamw": ("ADAMW", {"server": "DAEMON"},
              lambda opt, m: m.routes["fc.weight"]["route"] == "adamw"),
    "muon": ("MUON", {"server": "DAEMON"},
             lambda opt, m: m.routes["raw"]["route"] == "muon"),
    "experts": ("EXPERTS", {"server": "DAEMON"},
                lambda opt, m: "experts" in m.routes["moe"]["reason"]),
    "split": ("SPLIT", {"server": "DAEMON"},
              lambda opt, m: "split into" in m.routes["fc.weight"]["reason"]),
    "shards": ("SHARDS", {"server": "DAEMON"},
               lambda opt, m: m.routes["fc.weight"]["sharding"] == "rows"),
    "overlap": (False, {"server": "DAEMON"},
                lambda opt, m: m.routes["fc.weight"]["handoff"] == "step"),
    "overlap_forward": (True, {"server": "DAEMON", "model": "MODEL"},
                        lambda opt, m: opt._handoff.overlap_forward),
    "reduce_in_daemon": (True, {"server": "DAEMON"},
                         lambda opt, m: opt._layout.overlap.reduce_in_daemon),
}
NEW = {"adamw_lr": ("adamw_options", "AdamWOptions", "lr"),
       "adamw_betas": ("adamw_options", "AdamWOptions", "betas"),
       "adamw_eps": ("adamw_options", "AdamWOptions", "eps"),
       "adamw_wd": ("adamw_options", "AdamWOptions", "weight_decay"),
       "server": ("daemon_options", "DaemonOptions", "server"),
       "transport": ("daemon_options", "DaemonOptions", "transport"),
       "timeout": ("daemon_options", "DaemonOptions", "timeout"),
       "job_id": ("daemon_options", "DaemonOptions", "job_id"),
       "resume": ("daemon_options", "DaemonOptions", "resume"),
       "daemon_flags": ("daemon_options", "DaemonOptions", "flags"),
       "model": ("routing_options", "RoutingOptions", "model"),
       "adamw": ("routing_options", "RoutingOptions", "adamw"),
       "muon": ("routing_options", "RoutingOptions", "muon"),
       "experts": ("routing_options", "RoutingOptions", "experts"),
       "split": ("routing_options", "RoutingOptions", "split"),
       "shards": ("routing_options", "RoutingOptions", "shards"),
       "overlap": ("overlap_options", "OverlapOptions", "backward"),
       "overlap_forward": ("overlap_options", "OverlapOptions", "forward"),
       "reduce_in_daemon": ("overlap_options", "OverlapOptions", "reduce_in_daemon")}


class _Net(nn.Module):
    """raw (a 2-D nn.Parameter: AdamW by the rules), moe (a 3-D expert
    stack), fc (a Linear: Muon), emb (an Embedding: AdamW)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6, bias=False)
        self.emb = nn.Embedding(5, 4)
        self.raw = nn.Parameter(torch.randn(3, 4))
        self.moe = nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x):
        return self.fc(x).sum() + self.emb.weight.sum() + self.raw.sum() + self.moe.sum()


@pytest.mark.parametrize("keyword", sorted(FLAT))
def test_each_flat_keyword_warns_naming_the_new_spelling_and_still_works(daemon, keyword):
    net = _Net()
    values = {"DAEMON": daemon.address, "MODEL": net, "ADAMW": [net.fc.weight],
              "MUON": [net.raw], "EXPERTS": [net.moe],
              "SPLIT": {net.fc.weight: 2}, "SHARDS": {net.fc.weight: (0, 6, 6)}}
    value, others, check = FLAT[keyword]
    kw = {k: values.get(v, v) if isinstance(v, str) else v
          for k, v in {**others, keyword: value}.items()}
    params = net if "model" not in kw else list(net.parameters())
    if keyword in ("muon", "experts"):  # by the rules: raw and moe go to AdamW
        params = net
    group, cls, field = NEW[keyword]
    want = rf"DMuon\({keyword}=\.\.\.\) is deprecated: pass {group}={cls}\({field}=\.\.\.\)"
    with pytest.warns(DeprecationWarning, match=want) as got:
        opt = DMuon(params, **kw)
    try:
        warned = [w for w in got if f"DMuon({keyword}=" in str(w.message)]
        assert len(warned) == 1 and warned[0].filename == __file__
        routes = {r["name"]: r for r in opt.routing}
        assert check(opt, type("M", (), {"daemon": daemon.address, "routes": routes})), keyword
    finally:
        opt.close()


def test_the_grouped_spelling_does_not_warn(daemon):
    net = _Net()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        opt = DMuon(net, daemon_options=DaemonOptions(daemon.address),
                    adamw_options=AdamWOptions(lr=3e-3),
                    routing_options=RoutingOptions(adamw=[net.fc.weight], experts=[net.moe]),
                    overlap_options=OverlapOptions(backward=False))
    routes = {r["name"]: (r["route"], r["handoff"]) for r in opt.routing}
    assert routes == {"raw": ("adamw", None), "moe": ("muon", "step"),
                      "fc.weight": ("adamw", None), "emb.weight": ("adamw", None)}
    opt.close()


def test_an_unknown_keyword_is_pythons_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'overlapp'"):
        DMuon([torch.zeros(3, requires_grad=True)], overlapp=False)


@pytest.mark.parametrize("keyword, group", [
    (dict(model=None, adamw=["x"]), "routing_options"),
    (dict(overlap=False), "overlap_options"),
])
def test_a_flat_keyword_with_its_new_group_is_a_type_error(keyword, group):
    options = {"routing_options": RoutingOptions(),
               "overlap_options": OverlapOptions()}[group]
    with pytest.raises(TypeError, match=rf"both \w+= and {group}="):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            DMuon([torch.zeros(3, requires_grad=True)], **keyword, **{group: options})


def test_the_package_is_typed_and_stubs_its_extension():
    pkg = pathlib.Path(dmuon.__file__).parent
    assert (pkg / "py.typed").is_file()
    stub = (pkg / "_dmuon.pyi").read_text()
    ext = dmuon._native.load()
    public = sorted(n for n in dir(ext) if not n.startswith("_") or n == "__version__")
    missing = [n for n in public
               if f"class {n}" not in stub and f"def {n}(" not in stub
               and f"{n}:" not in stub]
    assert missing == []
    for cls in ("Client", "Session"):  # every method and property
        names = [n for n in vars(getattr(ext, cls)) if not n.startswith("_")]
        assert [n for n in names if f"def {n}(" not in stub] == [], cls
    sys.path.insert(0, str(pkg.parent))
    try:
        import make_wheel
    finally:
        sys.path.pop(0)
    assert all(make_wheel.is_package_file(n) for n in ("optim.py", "_dmuon.pyi", "py.typed"))

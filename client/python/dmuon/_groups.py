"""Parameter groups: the user's groups in, DMuon's Muon/AdamW groups and the
daemon's table and hyperparameter groups out."""

import warnings

import torch

CLASSIC = (3.4445, -4.775, 2.0315)
MUON_KEYS = ("momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
             "adjust_lr_fn", "method")
ADAMW_KEYS = ("adamw_lr", "adamw_betas", "adamw_eps", "adamw_wd")
# torch.optim.Muon's adjust_lr_fn values (None means "original").
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")


def check_hyperparameters(lr, weight_decay, momentum, use_addmm, adjust_lr_fn):
    """torch.optim.Muon's checks, with its exception types and messages
    (momentum in [0, 1): dmuond's)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not lr >= 0.0:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum should be in [0, 1) but is: {momentum}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if not isinstance(use_addmm, bool):
        raise ValueError(f"use_addmm should be a bool but is: {use_addmm!r}")
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")


def schedule(coefficients, steps):
    """torch's ns_coefficients -> the daemon's (schedule, coefficients)."""
    if isinstance(coefficients, str):
        return coefficients, []
    c = [tuple(float(x) for x in t) for t in (
        [coefficients] if len(coefficients) == 3 and not hasattr(coefficients[0], "__len__")
        else coefficients)]
    if any(len(t) != 3 for t in c) or not c:
        raise ValueError(f"DMuon: ns_coefficients must be (a, b, c) or a list of them, "
                         f"got {coefficients!r}")
    if len(c) == 1 and c[0] == CLASSIC:
        return "classic", []
    c = (c + [c[-1]] * steps)[:steps]
    return "custom", c


def user_groups(params):
    """Torch-style groups (and names, {id(param): name}, of (name, param)
    pairs) from `params`, checked as torch.optim.Optimizer checks them, with
    its exception types and messages: a tensor is a TypeError; a set warns
    (FutureWarning: its order differs between processes, and so between
    ranks), a set inside a group is a TypeError; anything that is not a
    tensor is a TypeError; names given for some parameters (or groups) and
    not for others are a ValueError."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable "
                        "of Tensors or dicts, but got " + torch.typename(params))
    if isinstance(params, set):
        warnings.warn(
            "optimizer parameters need to be organized in ordered collections, but the "
            "ordering of tensors in sets will change between runs. Please use a list "
            "instead. This will be an error in a future release.",
            FutureWarning, stacklevel=5)  # DMuon()'s caller (shim, __init__, Layout.of)
    params = list(params)
    if not params:
        raise ValueError("optimizer got an empty parameter list")
    groups = ([dict(g) for g in params] if isinstance(params[0], dict)
              else [{"params": params}])
    allowed = {"params", "lr", "weight_decay", "use_muon", *MUON_KEYS, *ADAMW_KEYS}
    named, with_names = {}, None
    for g in groups:
        g["params"], names = _group_params(g["params"])
        if with_names is not None and (names is not None) != with_names:
            raise ValueError(_names_mixed(names is not None))
        with_names = names is not None
        named.update({id(p): n for p, n in zip(g["params"], names or ())})
        unknown = set(g) - allowed
        if unknown:
            raise ValueError(f"DMuon: unknown parameter-group keys {sorted(unknown)} "
                             f"(known: {sorted(allowed)})")
    return groups, named


def _names_mixed(with_names):
    """torch.optim.Optimizer.add_param_group's message for a group with (or
    without) names among groups without (with) them."""
    return ("all optimizer param groups should be with/without names. cannot add param "
            f"group {'with names' if with_names else 'without names'} to the optimizer")


def _group_params(ps):
    """(tensors, names or None) of one group's "params", as torch reads
    them: a tensor, or an ordered iterable of tensors or (name, tensor)."""
    if isinstance(ps, torch.Tensor):
        ps = [ps]
    elif isinstance(ps, set):
        raise TypeError("optimizer parameters need to be organized in ordered "
                        "collections, but the ordering of tensors in sets will change "
                        "between runs. Please use a list instead.")
    tensors, names = [], []
    for p in ps:
        if isinstance(p, tuple):
            names.append(p[0])
            p = p[1]
        tensors.append(p)
    if names and len(names) != len(tensors):
        raise ValueError("all optimizer params should be with/without names. Some param "
                         "names are missing")
    for p in tensors:
        if not isinstance(p, torch.Tensor):
            raise TypeError("optimizer can only optimize Tensors, but one of the params "
                            "is " + torch.typename(p))
    return tensors, (names or None)


def check_names(param_group_named, optimizer_named):
    """add_param_group(): a group with names for an optimizer without them,
    or the other way round, is torch's ValueError."""
    if param_group_named != optimizer_named:
        raise ValueError(_names_mixed(param_group_named))


def split(groups, routes, shared, named=None):
    """Each user group -> a Muon group and an AdamW group (empty ones dropped);
    also the index of each Muon parameter's group. named: the user's
    parameter names ({id(param): name}, user_groups'): each group then has
    them as "param_names", right after "params", as torch.optim.Optimizer
    keeps the names of (name, parameter) pairs."""
    def params(rs):
        out = {"params": [r.param for r in rs]}
        if named:
            out["param_names"] = [named[id(r.param)] for r in rs]
        return out

    torch_groups, group_of = [], []
    for gi, g in enumerate(groups):
        h = {k: g.get(k, v) for k, v in shared.items()}
        mine = [r for r in routes if r.group == gi]
        muon = [r for r in mine if r.route == "muon"]
        rest = [r for r in mine if r.route != "muon"]
        if muon:
            group_of.extend([len(torch_groups)] * len(muon))
            torch_groups.append(dict(
                **params(muon), lr=h["lr"], weight_decay=h["weight_decay"],
                **{k: h[k] for k in MUON_KEYS}, use_muon=True))
        if rest:
            torch_groups.append(dict(
                **params(rest), lr=h["adamw_lr"], betas=h["adamw_betas"],
                eps=h["adamw_eps"], weight_decay=h["adamw_wd"], use_muon=False))
    return torch_groups, group_of


def table(muon, group_of):
    """The daemon's parameter table: Muon parameters in forward order, each
    with its layer (_routing.layer_ids: None = no layer)."""
    order = sorted(set(group_of))
    out = []
    for i, r in enumerate(muon):
        spec = dict(name=r.name, rows=r.matrix[0], cols=r.matrix[1],
                    sharding=r.sharding, forward_order=i,
                    group=order.index(group_of[i]), layer=r.layer)
        if r.row_range:
            spec.update(row_begin=r.row_range[0], row_end=r.row_range[1])
        if r.sharding == "blocks":  # a DTensor's local shard (_dtensor)
            spec.update(row_runs=list(r.dtensor.row_runs), col_runs=list(r.dtensor.col_runs))
        out.append(spec)
    return out


def specs(param_groups, group_of):
    """The daemon's hyperparameter groups, from DMuon's Muon groups."""
    out = []
    for g in sorted(set(group_of)):
        h = param_groups[g]
        sched, coefficients = schedule(h["ns_coefficients"], int(h["ns_steps"]))
        out.append(dict(
            momentum=float(h["momentum"]), nesterov=bool(h["nesterov"]),
            ns_steps=int(h["ns_steps"]), schedule=sched,
            coefficients=coefficients, method=str(h["method"]),
            adjust_lr_fn=h["adjust_lr_fn"] or "original", eps=float(h["eps"])))
    return out


def adamw_beta1(param_groups):
    """OneCycleLR/CyclicLR with cycle_momentum=True write 'momentum' into
    every group (DMuon's defaults have no 'betas') and mark it with
    'base_momentum'/'max_momentum': an AdamW group's is its beta1, as a
    torch.optim.AdamW's scheduler sets betas[0]. (An AdamW group added
    later gets the defaults' 'momentum' unmarked: not its beta1.)"""
    for group in param_groups:
        if (not group.get("use_muon", True) and "momentum" in group
                and ("max_momentum" in group or "base_momentum" in group)):
            group["betas"] = (group["momentum"], *tuple(group["betas"])[1:])

"""Parameter groups: the user's groups in, DMuon's Muon/AdamW groups and the
daemon's table and hyperparameter groups out."""

import torch

CLASSIC = (3.4445, -4.775, 2.0315)
MUON_KEYS = ("momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
             "adjust_lr_fn", "method")
ADAMW_KEYS = ("adamw_lr", "adamw_betas", "adamw_eps", "adamw_wd")
# torch.optim.Muon's adjust_lr_fn values (None means "original").
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")


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
    """Torch-style groups (and names, for (name, param) pairs) from `params`."""
    params = list(params)
    if not params:
        raise ValueError("optimizer got an empty parameter list")
    named = {}
    if isinstance(params[0], dict):
        groups = [dict(g) for g in params]
    elif isinstance(params[0], tuple):
        groups = [{"params": [p for _, p in params]}]
        named = {id(p): n for n, p in params}
    else:
        groups = [{"params": params}]
    allowed = {"params", "lr", "weight_decay", "use_muon", *MUON_KEYS, *ADAMW_KEYS}
    for g in groups:
        ps = g["params"]
        g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        unknown = set(g) - allowed
        if unknown:
            raise ValueError(f"DMuon: unknown parameter-group keys {sorted(unknown)} "
                             f"(known: {sorted(allowed)})")
    return groups, named


def split(groups, routes, shared):
    """Each user group -> a Muon group and an AdamW group (empty ones dropped);
    also the index of each Muon parameter's group."""
    torch_groups, group_of = [], []
    for gi, g in enumerate(groups):
        h = {k: g.get(k, v) for k, v in shared.items()}
        mine = [r for r in routes if r.group == gi]
        muon = [r.param for r in mine if r.route == "muon"]
        rest = [r.param for r in mine if r.route != "muon"]
        if muon:
            group_of.extend([len(torch_groups)] * len(muon))
            torch_groups.append(dict(
                params=muon, lr=h["lr"], weight_decay=h["weight_decay"],
                **{k: h[k] for k in MUON_KEYS}, use_muon=True))
        if rest:
            torch_groups.append(dict(
                params=rest, lr=h["adamw_lr"], betas=h["adamw_betas"],
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

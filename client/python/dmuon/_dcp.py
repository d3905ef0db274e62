"""DMuon and torch.distributed.checkpoint (DCP): save on N ranks, load on M.

    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict, set_optimizer_state_dict)
    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    # a later job, any number of ranks:
    sd = {"model": get_model_state_dict(model),
          "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])

DCP keeps an optimizer's "state" and "param_groups" only (DMuon's small
"dmuon" entry is dropped), keys them by parameter FQN, and loads into the
tensors of the destination state_dict (what a fresh optimizer's
state_dict() holds): an entry the destination lacks is not loaded.
DMuon.state_dict() has one layout, whoever calls it: torch.optim.Muon +
AdamW's (dmuon/_state.py), which is what DCP needs:

  - state[k]["momentum_buffer"] of every Muon parameter k: dmuond's fp32
    momentum in the parameter's shape and on its device; a DTensor laid
    out as the parameter (its placements and mesh, this rank's rows) when
    it is one, so DCP reshards it. A parameter orthogonalized as parts
    (experts=, split=) has its full-shape momentum assembled from its
    parts'. state[k]["step"]: dmuond's completed steps, which the daemon's
    step counter resumes from (the "dmuon" entry's count does not travel).
  - every AdamW parameter that requires grad and has no state yet gets
    AdamW's initial state (step 0, zero moments: what AdamW's first step
    makes, so equivalent to none), in opt.state too, so that a fresh
    optimizer's state_dict is a complete destination for dcp.load, and
    StateDictOptions(flatten_optimizer_state_dict=True)'s load (which
    rebuilds each parameter's state from the keys opt.state[p] lists)
    restores it. opt.state[p] of a Muon parameter lists "momentum_buffer"
    and "step" (read from dmuond only when a value is read), so that load
    restores the Muon momentum too.

load_state_dict() takes the dict without "dmuon" (a DTensor momentum_buffer
is made whole with full_tensor(), a collective: every rank loads).

DCP's _init_optim_state initializes an optimizer whose `state` is empty by
a step() with zero gradients and lr 0. DMuon's state always has an entry
per Muon parameter (its lazy momentum_buffer), so torch skips that call;
should it come anyway (is_init_step: zero gradients, lr 0 in every Muon
group, nothing trained and no step completed in this job), step() runs
AdamW's half only and dmuond's step counter and momentum stay as they are
(a zero gradient on a zero momentum with lr 0 changes nothing but the
count).

Not supported here: row-sharded plain tensors (shards=): their whole
matrices are in the "dmuon" entry, which DCP drops (load_state_dict then
raises, naming the parameter); use DTensor parameters, or save
opt.state_dict() whole.
"""

from __future__ import annotations

from . import _dtensor


def is_init_step(h) -> bool:
    """Whether this step() (of hand-off h, dmuon/_handoff.py) is
    torch.distributed.checkpoint's _init_optim_state: every Muon group's lr
    0, every Muon gradient zero (set directly, nothing handed to dmuond
    yet), no momentum and no step completed in this job. dmuond then need
    not step: on a zero momentum a zero gradient with lr 0 changes nothing
    but its step count."""
    session = h.link.session
    if (session is None or h.pending or any(h.handed) or any(h.trained)
            or session.step != 1):
        return False
    if any(g["use_muon"] and float(g["lr"]) != 0.0 for g in h.groups):
        return False
    seen = False
    for r in h.table.muon:
        g = r.param.grad
        if g is None:
            if r.param.requires_grad:
                return False
            continue
        if _dtensor.local(g).count_nonzero().item() != 0:
            return False
        seen = True
    return seen

"""DMuon's wiring: where each Muon matrix's gradient is handed over (a
backward hook, DDP's comm hook, or step(): plan()), and the hooks that do
it (Hooks), each holding a weak reference to the hand-off
(dmuon/_handoff.py), never to DMuon: an optimizer dropped without close()
leaves hooks that do nothing.
"""

from __future__ import annotations

import weakref

import torch

from . import _ddp, _routing

try:
    from torch.nn.parallel import DistributedDataParallel as _DDP
except ImportError:  # torch built without distributed
    _DDP = ()


def _hook(ref, fn_name, *bound):
    def hook(*args):
        owner = ref()
        if owner is not None:
            return getattr(owner, fn_name)(*bound)
    return hook


def _applied_in_forward_of(module):
    """overlap_forward: [(m, parameters)], each parameter's update applied by
    m's forward pre-hook, before m's forward uses it: a module's own
    parameters, except that nn.MultiheadAttention takes its submodules'
    (out_proj is never called: F.multi_head_attention_forward reads
    out_proj.weight directly, so its pre-hook would never run and its update
    would land after the forward had used, and saved, the old value)."""
    out, inside = [], set()
    for m in module.modules():
        if id(m) in inside:
            continue
        if isinstance(m, torch.nn.MultiheadAttention):
            inside.update(id(c) for c in m.modules())
            out.append((m, list(m.parameters())))
        else:
            out.append((m, [p for p in m._parameters.values() if p is not None]))
    return out


def plan(entries, ddp, world, reduce_in_daemon, overlap, module):
    """Sets each table entry's sharding (unreduced: reduce_in_daemon) and
    hand-off: "ddp" (DDP's comm hook), "hook" (a backward hook) or "step"
    (at step()). Parameters DMuon hands over itself are left out of a DDP
    built on `module` later (several ranks)."""
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    # DDP(find_unused_parameters=True) hands its comm hook zeros for a
    # parameter no rank used, then leaves its .grad None, which
    # torch.optim.Muon skips: its matrices leave at step(), DDP-reduced,
    # when .grad says which ones trained.
    unused = bool(getattr(ddp, "find_unused_parameters", False))
    mark = []
    for r in entries:
        in_ddp = ddp is not None and _routing.param_name(r) not in ignored
        if (r.sharding != "rows" and reduce_in_daemon and world > 1
                and getattr(r, "dtensor", None) is None  # a DTensor's is reduced
                and not (in_ddp and unused)):
            r.sharding = "unreduced"
        if in_ddp:
            r.handoff = "ddp" if overlap and not unused else "step"
        elif not overlap or (world > 1 and r.sharding == "replicated"):
            r.handoff = "step"  # the user reduces after backward, if at all
        else:
            # A DTensor's hook leaves a gradient that needs a collective
            # (Partial) to step() (_dtensor.needs_collective).
            r.handoff = "hook"
        if r.sharding != "replicated" and ddp is None and module is not None:
            mark.append(_routing.param_name(r))
    if mark and world > 1:
        # A DDP built on this module later leaves these out of its all-reduce.
        old = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []) or [])
        _DDP._set_params_and_buffers_to_ignore_for_model(
            module, sorted(set(old) | set(mark)))


class Hooks:
    """The hooks of one hand-off (dmuon/_handoff.py), which they reach by a
    weak reference: each Muon gradient's post-accumulate-grad hook, DDP's
    comm hook, the model's forward pre-hook (a step interrupted before it
    committed is rolled back, one that committed completed), and with
    overlap_forward each module's pre-hook that applies its updates and the
    model's forward hook that applies the rest."""

    def __init__(self, handoff):
        self._ref = weakref.ref(handoff)
        self.handles = []

    def install(self, table, module, ddp, pg, world, overlap_forward):
        """The hooks of a new optimizer's table."""
        self._grads(table, 0)
        if ddp is not None:
            try:
                ddp.register_comm_hook(None, _ddp.comm_hook(self._ref, pg, world))
            except RuntimeError as e:
                raise RuntimeError(
                    f"DMuon: could not register its DDP comm hook ({e}); build the "
                    "optimizer before the first backward and without another comm "
                    "hook, or pass the unwrapped model with overlap_options="
                    "OverlapOptions(reduce_in_daemon=True)"
                ) from e
        if module is not None:
            # Before autograd meets a parameter whose shape changed: a clear
            # error instead of one from inside backward.
            self._on(module.register_forward_pre_hook, "before_forward")
        if overlap_forward:
            self._appliers(table, 0, module)
            self._on(module.register_forward_hook, "synchronize")

    def extend(self, table, n_old, module, overlap_forward):
        """The hooks of the entries a grown table added after its first n_old."""
        self._grads(table, n_old)
        if overlap_forward:
            self._appliers(table, n_old, module)
        if n_old == 0 and module is not None:
            self._on(module.register_forward_pre_hook, "before_forward")

    def grad(self, i, r):
        """Hands table entry i (r) over as soon as backward has accumulated
        its gradient; a frozen one is handed over in step() until it is
        unfrozen (step() then hooks it)."""
        if not r.param.requires_grad:
            r.handoff = "step (frozen)"
            return
        self._on(r.param.register_post_accumulate_grad_hook, "on_grad", i)
        r.handoff = "hook"

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _on(self, register, fn_name, *bound):
        self.handles.append(register(_hook(self._ref, fn_name, *bound)))

    def _grads(self, table, start):
        for i in range(start, len(table.muon)):
            if table.muon[i].handoff == "hook":  # after .grad holds the whole gradient
                self.grad(i, table.muon[i])

    def _appliers(self, table, start, module):
        """overlap_forward: each module's pre-hook applies the updates of the
        parameters its forward uses (entries from `start` on)."""
        index = _routing.indices(table.muon[start:])  # every entry (part) of a parameter
        for m, params in _applied_in_forward_of(module):
            ids = [start + k for p in params for k in index.get(id(p), ())]
            if ids:
                self._on(m.register_forward_pre_hook, "apply_pending", tuple(ids))

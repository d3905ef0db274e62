"""DMuon's wiring: where each Muon matrix's gradient is handed over (a
backward hook, DDP's comm hook, or step()), the hooks that do it, and the
dmuond session they feed, attached at construction and reopened with a
larger table by add_param_group().

_WiringMixin is a part of DMuon (dmuon.optim), split out by concern; it uses
DMuon's attributes: _muon, _index, _group_of, _module, _ddp, _pg, _rank,
_world, _overlap, _overlap_forward, _reduce_in_daemon, _open_args, _server,
_session, _daemon, _region, _staging, _finalizer, _handles, address, job_id,
pool_owner, param_groups.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from . import _ddp, _routing, _session

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


class _WiringMixin:
    """DMuon's hand-off plan, hooks and session (see the module docstring)."""

    def _reopen(self, table):
        """A session with the grown table (add_param_group: MuonTable.grown,
        planned by _replan); the momentum of the matrices it had carried
        over."""
        old = self._session.get_state() if self._session is not None else None
        n_old = len(self._table.muon)
        if self._session is not None:
            self._finalizer.detach()
            _session.release([self._session], self._region)
            self._session = None
        self._table = table
        muon = table.muon
        timeout, transport = self._open_args
        server = self.address if self.address is not None else self._server
        (session, self._region, self._staging, daemon, address, self.job_id,
         self.pool_owner) = _session.open_session(
            self._pg, self._rank, self._world, server, None, timeout, transport, (),
            list(table.table), list(table.specs), self._cuda_device(transport))
        if self._daemon is None:
            self._daemon = daemon
        self.address = address
        self._attach(session)
        if old is not None:
            carried = dict(zip(old["names"], old["momentum"]))
            momentum = [carried.get(r.name, np.zeros(r.matrix, np.float32)) for r in muon]
            session.set_state({"completed_steps": int(old["completed_steps"]),
                               "names": session.names, "momentum": momentum})
        self._trained += [False] * (len(muon) - n_old)
        ref = weakref.ref(self)
        for i in range(n_old, len(muon)):
            if muon[i].handoff == "hook":
                self._hook_grad(i)
        if self._overlap_forward:
            new = _routing.indices(muon[n_old:])  # every table entry (part) of a parameter
            for m, params in _applied_in_forward_of(self._module):
                ids = [n_old + k for p in params for k in new.get(id(p), ())]
                if ids:
                    self._handles.append(m.register_forward_pre_hook(
                        _hook(ref, "_apply_pending", tuple(ids))))
        if n_old == 0 and self._module is not None:
            self._handles.append(self._module.register_forward_pre_hook(
                _hook(ref, "_before_forward")))
        self._momentum_cache = None
        self._install_state()
        self._reset_step()

    def _replan(self, entries):
        """The hand-off plan of a grown table (MuonTable.grown): the entries
        it had keep their hand-off (their hooks are in place)."""
        kept = [r.handoff for r in self._table.muon]
        self._plan_sharding(entries)
        for r, handoff in zip(entries, kept):
            r.handoff = handoff

    def _plan_sharding(self, entries):
        reduce_in_daemon, overlap, module = (self._reduce_in_daemon, self._overlap,
                                             self._module)
        ignored = set(getattr(self._ddp, "parameters_to_ignore", ()) or ())
        # DDP(find_unused_parameters=True) hands its comm hook zeros for a
        # parameter no rank used, then leaves its .grad None, which
        # torch.optim.Muon skips: its matrices leave at step(), DDP-reduced,
        # when .grad says which ones trained.
        unused = bool(getattr(self._ddp, "find_unused_parameters", False))
        mark = []
        for r in entries:
            in_ddp = self._ddp is not None and _routing.param_name(r) not in ignored
            if (r.sharding != "rows" and reduce_in_daemon and self._world > 1
                    and getattr(r, "dtensor", None) is None  # a DTensor's is reduced
                    and not (in_ddp and unused)):
                r.sharding = "unreduced"
            if in_ddp:
                r.handoff = "ddp" if overlap and not unused else "step"
            elif not overlap or (self._world > 1 and r.sharding == "replicated"):
                r.handoff = "step"  # the user reduces after backward, if at all
            else:
                # A DTensor's hook leaves a gradient that needs a collective
                # (Partial) to step() (_dtensor.needs_collective).
                r.handoff = "hook"
            if r.sharding != "replicated" and self._ddp is None and module is not None:
                mark.append(_routing.param_name(r))
        if mark and self._world > 1:
            # A DDP built on this module later leaves these out of its all-reduce.
            old = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []) or [])
            _DDP._set_params_and_buffers_to_ignore_for_model(
                module, sorted(set(old) | set(mark)))

    def _cuda_device(self, transport):
        """The one CUDA device of the Muon parameters (a GPU transport moves
        them without host staging), else None."""
        devices = {r.param.device for r in self._table.muon}
        if transport in ("cuda_ipc", "nccl") and len(devices) > 1:
            raise ValueError(f"DMuon: transport='{transport}' needs every Muon "
                             f"parameter on one CUDA device; they are on "
                             f"{sorted(str(d) for d in devices)}")
        device = next(iter(devices))
        if device.type == "cuda" or transport in ("cuda_ipc", "nccl"):
            return device  # a CPU device with a GPU transport: open_session says so
        return None

    def _attach(self, session):
        self._session = session
        n = len(self._table.muon)
        if self._region is not None:  # GPU memory of this process
            self._grad, self._upd = list(self._region.grad), list(self._region.upd)
        else:
            self._grad = [torch.from_numpy(session.gradient(i)) for i in range(n)]
            self._upd = [torch.from_numpy(session.update(i, writable=True))
                         for i in range(n)]
        # The finalizer owns the session through a list: close() empties it so
        # the channel is gone before the private daemon is told to stop; the
        # GPU region is freed only after the daemon released it
        # (_session.release: closed with region_released, or the private
        # daemon exited).
        self._finalizer = weakref.finalize(self, _session.close, [session], self._daemon,
                                           self._region)

    def _install_hooks(self, module, overlap):
        ref = weakref.ref(self)
        for i, r in enumerate(self._table.muon):
            if r.handoff == "hook":  # after .grad holds the whole gradient
                self._hook_grad(i)
        if self._ddp is not None:
            try:
                self._ddp.register_comm_hook(None, _ddp.comm_hook(ref, self._pg, self._world))
            except RuntimeError as e:
                raise RuntimeError(
                    f"DMuon: could not register its DDP comm hook ({e}); build the "
                    "optimizer before the first backward and without another comm "
                    "hook, or pass the unwrapped model with reduce_in_daemon=True"
                ) from e
        if module is not None:
            # Before autograd meets a parameter whose shape changed: a clear
            # error instead of one from inside backward.
            self._handles.append(module.register_forward_pre_hook(
                _hook(ref, "_before_forward")))
        if self._overlap_forward:
            index = _routing.indices(self._table.muon)  # every table entry (part) of a parameter
            for m, params in _applied_in_forward_of(module):
                ids = [i for p in params for i in index.get(id(p), ())]
                if ids:
                    self._handles.append(m.register_forward_pre_hook(
                        _hook(ref, "_apply_pending", tuple(ids))))
            self._handles.append(module.register_forward_hook(_hook(ref, "synchronize")))

    def _hook_grad(self, i):
        """Hands parameter i over as soon as backward has accumulated its
        gradient; a frozen one is handed over in step() until it is unfrozen
        (step() then hooks it)."""
        r = self._table.muon[i]
        if not r.param.requires_grad:
            r.handoff = "step (frozen)"
            return
        self._handles.append(r.param.register_post_accumulate_grad_hook(
            _hook(weakref.ref(self), "_on_grad", i)))
        r.handoff = "hook"

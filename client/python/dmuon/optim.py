"""dmuon.optim.DMuon: torch.optim.Muon's semantics, computed by dmuond.

    from dmuon.optim import DMuon
    opt = DMuon(model, lr=0.02, weight_decay=0.01, adamw=[model.lm_head])

Every matrix (2-D weight, or conv weight flattened to out x in*k*k) is handed
to dmuond, which owns its momentum and returns lr_scale(A, B) * NS(U) with
U the (Nesterov) momentum step; this side applies

    W <- W * (1 - lr * weight_decay) - lr * update

which is torch.optim.Muon's `param.mul_(1 - lr * wd); param.add_(O,
alpha=-lr * lr_scale)` with lr_scale folded into the update (the same
numbers up to one fp32 rounding of the product). Every other parameter is
updated here by torch.optim.AdamW (adamw_lr, adamw_betas, adamw_eps,
adamw_wd). See client/python/README.md for routing, overlap, accumulation,
state_dict, DDP and errors.

(This module was dmuon.torch, a name that shadowed `torch` inside the
package; dmuon.torch still imports as an alias of it.)
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.optim.optimizer import ParamsT

from . import Session, _ddp, _groups, _native, _routing, _session
from ._groups import CLASSIC

try:
    from torch.distributed import ProcessGroup
except ImportError:  # torch built without distributed
    if not TYPE_CHECKING:
        ProcessGroup = Any

# ns_coefficients: one (a, b, c) triple for every step, a list of per-step
# triples, or a named schedule ("classic", "polar_express", "you").
NSCoefficients = tuple[float, float, float] | Sequence[Sequence[float]] | str
# adamw= / muon= entries: parameters, modules (all their parameters) or names.
ParamSelector = Iterable[Tensor | nn.Module | str]
# shards=: {parameter or its name: (row_begin, row_end, total_rows)}.
Shards = Mapping[Tensor | str, tuple[int, int, int]]

try:
    from torch.nn.parallel import DistributedDataParallel as _DDP
except ImportError:  # torch built without distributed
    _DDP = ()


class _MuonState(dict):
    """opt.state[p] of a Muon parameter: "momentum_buffer" is read from
    dmuond when asked for (a copy in the parameter's shape, as
    torch.optim.Muon keeps it; writing to it changes nothing in dmuond: use
    load_state_dict). Never stored, so it never goes into state_dict()'s
    "state" (the momentum is in its "dmuon" entry)."""

    def __init__(self, owner, index, items=()):
        super().__init__(items)
        self._owner, self._index = owner, index

    def __missing__(self, key):
        owner = self._owner()
        if key != "momentum_buffer" or owner is None:
            raise KeyError(key)
        return owner._momentum_buffer(self._index)

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key):
        return key == "momentum_buffer" or super().__contains__(key)

    def __reduce__(self):  # pickles (torch.save of opt.state) as a plain dict
        return (dict, (dict(self),))


def _hook(ref, fn_name, *bound):
    def hook(*args):
        owner = ref()
        if owner is not None:
            return getattr(owner, fn_name)(*bound)
    return hook


class DMuon(torch.optim.Optimizer):
    """Muon through dmuond (matrices) plus a local AdamW (everything else).

    params: a model (nn.Module, DDP included: best, names and embeddings are
    known), an iterable of parameters, of (name, parameter) pairs, or of
    parameter-group dicts (which may override any hyperparameter below,
    adamw_* included, and may say "use_muon": True/False).
    The positional parameters are torch.optim.Muon's, in its order and with
    its defaults: lr (a float or a 1-element tensor), weight_decay, momentum,
    nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn (None/"original",
    "match_rms_adamw" or "spectral_unclamped"). Everything after them is
    keyword-only and DMuon's own: use_addmm (accepted so calls written for
    torch versions whose Muon has it work unchanged; it picks how torch forms
    the same products, and dmuond's kernels make that choice themselves),
    method ("direct", "gram", "auto"), and the options below.
    server: "auto" (a private dmuond for this process, or for the process
    group, stopped with the optimizer), "host:port" of a running dmuond, or a
    list of addresses (a pool: each matrix goes to one of its daemons, by a
    plan over their devices that rank 0 makes and sends to every rank; see
    pool_owner).
    """

    def __init__(
        self,
        params: ParamsT | nn.Module,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: NSCoefficients = CLASSIC,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        use_addmm: bool = False,
        method: str = "direct",
        server: str | Sequence[str] = "auto",
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_wd: float = 0.01,
        model: nn.Module | None = None,
        adamw: ParamSelector = (),
        muon: ParamSelector = (),
        shards: Shards | None = None,
        overlap: bool = True,
        overlap_forward: bool = False,
        reduce_in_daemon: bool = False,
        process_group: ProcessGroup | None = None,
        job_id: str | None = None,
        timeout: float = 60.0,
        transport: str = "auto",
        daemon_flags: Sequence[str] = (),
        verbose: bool = False,
    ) -> None:
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
        if adjust_lr_fn not in _groups.ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        if isinstance(params, nn.Module):
            if model is not None and model is not params:
                raise ValueError("DMuon: params is a model and model= names another one")
            model, params = params, list(params.parameters())
        self._ddp = model if isinstance(model, _DDP) else None
        module = self._ddp.module if self._ddp is not None else model
        if overlap_forward and module is None:
            raise ValueError("DMuon: overlap_forward=True needs the model (pass it as "
                             "params or model=) to hook its modules' forward")
        adamw, muon = list(adamw), list(muon)  # kept for add_param_group
        groups, named = _groups.user_groups(params)
        routes = _routing.resolve(groups, module, adamw, muon, shards, named)
        self._module, self._selectors, self._user_groups = module, (adamw, muon), len(groups)
        self._reduce_in_daemon, self._overlap = reduce_in_daemon, overlap
        self._open_args, self._server = (timeout, transport), server
        self._pg, self._rank, self._world = _ddp.world(process_group)
        self._overlap_forward = bool(overlap_forward)
        self._accumulating = False
        self._wait = 0.0
        self._error = None
        self._finalizer = None
        self._handles = []
        # wait: blocked on dmuond; handoff: copying gradients out and declaring
        # them (in backward's hooks, or in step()).
        self.stats = {"steps": 0, "wait_seconds": 0.0, "last_wait_seconds": 0.0,
                      "last_step_seconds": 0.0, "handoff_seconds": 0.0}
        shared = dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                      nesterov=nesterov, ns_coefficients=ns_coefficients, eps=eps,
                      ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, method=method,
                      adamw_lr=adamw_lr, adamw_betas=adamw_betas,
                      adamw_eps=adamw_eps, adamw_wd=adamw_wd)
        torch_groups, group_of = _groups.split(groups, routes, shared)
        self._shared = shared
        self._constructing = True
        super().__init__(torch_groups, dict(lr=lr, weight_decay=weight_decay))
        self._constructing = False
        self._routes = routes
        self._muon = [r for r in routes if r.route == "muon"]
        self._group_of = group_of  # Muon index -> index in self.param_groups
        self._index = {id(r.param): i for i, r in enumerate(self._muon)}
        self._adamw = None
        self._relink_adamw()
        self._plan_sharding(reduce_in_daemon, overlap, module)
        self._session, self._daemon, self.address, self.job_id = None, None, None, None
        # A pool: the daemon (index into server) of each Muon parameter, the
        # same on every rank (rank 0's plan); None for a single daemon.
        self.pool_owner = None
        self._grad = self._upd = self._region = self._staging = None
        self._handoff_lock = threading.Lock()
        if self._muon:
            (session, self._region, self._staging, self._daemon, self.address,
             self.job_id, self.pool_owner) = _session.open_session(
                self._pg, self._rank, self._world, server, job_id, timeout, transport,
                daemon_flags, _groups.table(self._muon, group_of),
                _groups.specs(self.param_groups, group_of), self._cuda_device(transport))
            self._attach(session)
            self._install_hooks(module, overlap)
        n = len(self._muon)
        # Whether each Muon matrix's momentum may be non-zero (it had a gradient,
        # or a checkpoint was loaded): only then does a missing gradient cost
        # anything (see step()).
        self._trained = [False] * n
        self._warned_absent = set()
        self._momentum_cache = None  # {name: tensor} for opt.state[p]
        self._install_state()
        self._reset_step()
        if self._rank == 0:
            if verbose:
                print(self.routing_table, flush=True)
            else:
                print(_routing.format_summary(self._routes, self.param_groups,
                                              self._where()), file=sys.stderr, flush=True)

    # ----------------------------------------------------------- construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a user parameter group, routed as at construction (model,
        adamw=, muon=; the construction's hyperparameters are its defaults).
        New Muon matrices reopen the dmuond session with the larger table:
        the momentum of the others and the step count are carried over (a
        GetState and a SetState), the new ones start from zero, as in
        torch.optim.Muon. Between steps only; one process (not with
        torch.distributed)."""
        if getattr(self, "_constructing", False):
            super().add_param_group(param_group)
            return
        self._at_boundary("add_param_group")
        groups, named = _groups.user_groups([param_group])
        known = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in known for p in groups[0]["params"]):
            raise ValueError("some parameters appear in more than one parameter group")
        routes = _routing.resolve(groups, self._module, *self._selectors, None, named)
        torch_groups, group_of = _groups.split(groups, routes, self._shared)
        for r in routes:
            r.group = self._user_groups
            if r.name.startswith("params[0]["):
                r.name = f"params[{self._user_groups}][" + r.name[len("params[0]["):]
        new_muon = [r for r in routes if r.route == "muon"]
        if new_muon and self._world > 1:
            raise NotImplementedError(
                "DMuon.add_param_group: new Muon matrices reopen the dmuond session, "
                "which needs every rank at once; with torch.distributed, create the "
                "DMuon with every group (or add only AdamW parameters: use_muon=False)")
        base = len(self.param_groups)
        for g in torch_groups:
            super().add_param_group(g)
        self._user_groups += 1
        self._routes.extend(routes)
        self._relink_adamw()
        if new_muon:
            self._reopen(new_muon, [base + g for g in group_of])

    def _reopen(self, new_muon, new_group_of):
        """A session with the table grown by new_muon; momentum carried over."""
        old = self._session.get_state() if self._session is not None else None
        muon, group_of = self._muon + new_muon, self._group_of + new_group_of
        for r, layer in zip(muon, _routing.layer_ids([r.name for r in muon])):
            r.layer = layer
        if self._session is not None:
            self._finalizer.detach()
            _session.release([self._session], self._region)
            self._session = None
        self._muon, self._group_of = muon, group_of
        self._index = {id(r.param): i for i, r in enumerate(muon)}
        kept = [r.handoff for r in muon[:len(muon) - len(new_muon)]]
        self._plan_sharding(self._reduce_in_daemon, self._overlap, self._module)
        for r, handoff in zip(muon, kept):  # their hooks are in place
            r.handoff = handoff
        timeout, transport = self._open_args
        server = self.address if self.address is not None else self._server
        (session, self._region, self._staging, daemon, address, self.job_id,
         self.pool_owner) = _session.open_session(
            self._pg, self._rank, self._world, server, None, timeout, transport, (),
            _groups.table(muon, group_of), _groups.specs(self.param_groups, group_of),
            self._cuda_device(transport))
        if self._daemon is None:
            self._daemon = daemon
        self.address = address
        self._attach(session)
        if old is not None:
            carried = dict(zip(old["names"], old["momentum"]))
            momentum = [carried.get(r.name, np.zeros(r.matrix, np.float32)) for r in muon]
            session.set_state({"completed_steps": int(old["completed_steps"]),
                               "names": session.names, "momentum": momentum})
        n_old = len(muon) - len(new_muon)
        self._trained += [False] * len(new_muon)
        ref = weakref.ref(self)
        for i in range(n_old, len(muon)):
            if muon[i].handoff == "hook":
                self._hook_grad(i)
        if self._overlap_forward:
            new = {id(r.param): n_old + k for k, r in enumerate(new_muon)}
            for m in self._module.modules():
                ids = [new[id(p)] for p in m._parameters.values()
                       if p is not None and id(p) in new]
                if ids:
                    self._handles.append(m.register_forward_pre_hook(
                        _hook(ref, "_apply_pending", tuple(ids))))
        if n_old == 0 and self._module is not None:
            self._handles.append(self._module.register_forward_pre_hook(
                _hook(ref, "_check_shapes")))
        self._momentum_cache = None
        self._install_state()
        self._reset_step()

    def _relink_adamw(self):
        groups = [g for g in self.param_groups if not g["use_muon"]]
        if not groups:
            return
        if self._adamw is None:
            self._adamw = torch.optim.AdamW(groups)
        for g in groups:  # a loaded state_dict may lack newer torch's keys
            for k, v in self._adamw.defaults.items():
                g.setdefault(k, v)
        self._adamw.param_groups = groups
        self._adamw.state = self.state

    def _plan_sharding(self, reduce_in_daemon, overlap, module):
        ignored = set(getattr(self._ddp, "parameters_to_ignore", ()) or ())
        mark = []
        for r in self._muon:
            if r.sharding != "rows" and reduce_in_daemon and self._world > 1:
                r.sharding = "unreduced"
            in_ddp = self._ddp is not None and r.name not in ignored
            if in_ddp:
                r.handoff = "ddp" if overlap else "step"
            elif not overlap or (self._world > 1 and r.sharding == "replicated"):
                r.handoff = "step"  # the user reduces after backward, if at all
            else:
                r.handoff = "hook"
            if r.sharding != "replicated" and self._ddp is None and module is not None:
                mark.append(r.name)
        if mark and self._world > 1:
            # A DDP built on this module later leaves these out of its all-reduce.
            old = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []) or [])
            _DDP._set_params_and_buffers_to_ignore_for_model(
                module, sorted(set(old) | set(mark)))

    def _cuda_device(self, transport):
        """The one CUDA device of the Muon parameters (a GPU transport moves
        them without host staging), else None."""
        devices = {r.param.device for r in self._muon}
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
        n = len(self._muon)
        if self._region is not None:  # GPU memory of this process
            self._grad, self._upd = list(self._region.grad), list(self._region.upd)
        else:
            self._grad = [torch.from_numpy(session.gradient(i)) for i in range(n)]
            self._upd = [torch.from_numpy(session.update(i, writable=True))
                         for i in range(n)]
        self._opened = _groups.specs(self.param_groups, self._group_of)
        # The finalizer owns the session through a list: close() empties it so
        # the channel is gone before the private daemon is told to stop; the
        # GPU region is freed only after the daemon released it
        # (_session.release: closed with region_released, or the private
        # daemon exited).
        self._finalizer = weakref.finalize(self, _session.close, [session], self._daemon,
                                           self._region)

    def _install_hooks(self, module, overlap):
        ref = weakref.ref(self)
        for i, r in enumerate(self._muon):
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
                _hook(ref, "_check_shapes")))
        if self._overlap_forward:
            for m in module.modules():
                ids = [self._index[id(p)] for p in m._parameters.values()
                       if p is not None and id(p) in self._index]
                if ids:
                    self._handles.append(m.register_forward_pre_hook(
                        _hook(ref, "_apply_pending", tuple(ids))))
            self._handles.append(module.register_forward_hook(_hook(ref, "synchronize")))

    def _hook_grad(self, i):
        """Hands parameter i over as soon as backward has accumulated its
        gradient; a frozen one is handed over in step() until it is unfrozen
        (step() then hooks it)."""
        r = self._muon[i]
        if not r.param.requires_grad:
            r.handoff = "step (frozen)"
            return
        self._handles.append(r.param.register_post_accumulate_grad_hook(
            _hook(weakref.ref(self), "_on_grad", i)))
        r.handoff = "hook"

    # ------------------------------------------------------------- per step
    def _reset_step(self):
        n = len(self._muon)
        self._handed, self._applied = [False] * n, [False] * n
        self._received = [False] * n  # nccl: update received
        self._absent = [False] * n  # no gradient this step: left unchanged
        self._step_lr = [(0.0, 0.0)] * n
        self._pending = False

    def _on_grad(self, i):
        if self._accumulating or (self._ddp is not None
                                  and not self._ddp.require_backward_grad_sync):
            return
        try:
            self._handoff(i, self._muon[i].param.grad)
        except Exception as e:  # noqa: BLE001 - raised by the next step()
            self._error = self._error or e

    def _handoff_flat(self, i, flat):
        try:
            self._handoff(i, flat)
        except Exception as e:  # noqa: BLE001 - raised by the next step()
            self._error = self._error or e

    def _check_shapes(self):
        for r in self._muon:
            if tuple(r.param.shape) != r.shape0:
                self._shape_error(r)

    @staticmethod
    def _shape_error(r):
        raise ValueError(
            f"DMuon: parameter {r.name} now has shape {list(r.param.shape)}; it was "
            f"registered with dmuond as {list(r.shape0)}. The parameter table is "
            "fixed when the optimizer is created: create a new DMuon (and "
            "load_state_dict) after changing a model's shapes")

    def _bucket_plan(self, params):
        """[(muon index or None, kind, offset, numel)] for a DDP bucket's
        parameters: "reduce" (all-reduce), "after" (all-reduce, then hand off),
        "local" (hand off at once, no all-reduce), "skip" (neither: step())."""
        plan, offset = [], 0
        for p in params:
            i = self._index.get(id(p))
            if i is None:
                kind = "reduce"
            elif self._muon[i].sharding == "replicated":
                kind = "after" if self._muon[i].handoff == "ddp" else "reduce"
            else:
                kind = "local" if self._muon[i].handoff == "ddp" else "skip"
            plan.append((i, kind, offset, p.numel()))
            offset += p.numel()
        return plan

    def _handoff(self, i, grad):
        if self._pending:
            self.synchronize()
        r = self._muon[i]
        if self._handed[i]:
            raise RuntimeError(
                f"DMuon: {r.name} got another gradient after it was handed to dmuond "
                f"for step {self._session.step}; with gradient accumulation, run "
                "every backward but the last micro-batch's inside "
                "`with optimizer.no_sync():` (or DDP's no_sync()), or use overlap=False")
        if tuple(r.param.shape) != r.shape0 or (grad is not None and grad.numel() !=
                                                 self._grad[i].numel()):
            self._shape_error(r)
        t0 = time.perf_counter()
        buf = self._grad[i]
        if grad is None:
            # The protocol has no "no gradient this step": dmuond gets zeros,
            # and _apply leaves the parameter unchanged (step()).
            self._absent[i] = True
            buf.zero_()
        elif not (r.sharding == "replicated" and self._rank != 0):
            buf.copy_(grad.detach().reshape(buf.shape))  # rank 0's is the one used
        if grad is not None:
            self._trained[i] = True
        if self._region is None:
            self._session.gradient_ready(i)
        else:
            # Hand-offs can come from several threads (autograd's, DDP's comm
            # hook callbacks); over nccl the daemon receives in declaration
            # order, so each send and its declaration go together.
            with self._handoff_lock:
                self._region.handed([i])  # cuda_ipc: event after the copy; nccl: send
                self._session.gradient_ready(i)
        self._handed[i] = True
        self.stats["handoff_seconds"] += time.perf_counter() - t0

    def _apply(self, i):
        if self._applied[i]:
            return
        r = self._muon[i]
        t0 = time.perf_counter()
        if self._region is not None and self._region.kind == "nccl":
            self._receive_until(i)
        self._session.wait_update(i)
        self._wait += time.perf_counter() - t0
        lr, wd = self._step_lr[i]
        p = r.param
        with torch.no_grad():
            if self._absent[i]:
                pass  # torch.optim.Muon: no decay, no update without a gradient
            elif self._session.skipped(i):
                warnings.warn(f"DMuon: dmuond skipped {r.name} at step "
                              f"{self._session.step} (non-finite gradient); "
                              "it is left unchanged", RuntimeWarning)
            else:
                u = self._upd[i]
                if p.device != u.device or p.dtype != u.dtype:
                    u = u.to(device=p.device, dtype=p.dtype)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(u.view(p.shape), alpha=-lr)
        self._applied[i] = True

    def _receive_until(self, i):
        """nccl: posts the update receives in the order dmuond announces them
        (one group per announcement) until update i's is posted; torch's
        stream orders the receive before the update is applied."""
        while not self._received[i]:
            ids = self._session.next_announced()
            if not ids:
                raise RuntimeError(f"DMuon: dmuond announced every update of step "
                                   f"{self._session.step} but not {self._muon[i].name}'s")
            self._region.receive(ids)
            for j in ids:
                self._received[j] = True

    @contextlib.contextmanager
    def _explained(self):
        """dmuon errors raised inside, explained (_explain: a dead private
        daemon is named, with how it ended, its log and the next step)."""
        try:
            yield
        except _native.load().Error as e:
            err = self._explain(e)
            if err is e:
                raise
            raise err from e

    def _apply_pending(self, ids):
        if self._pending:
            with self._explained():
                for i in ids:
                    self._apply(i)

    def synchronize(self) -> None:
        """Applies every outstanding update of the last step (overlap_forward)."""
        if not self._pending:
            return
        with self._explained():
            for i in range(len(self._muon)):
                self._apply(i)
            self._session.finish_step()
        self._reset_step()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate into .grad without handing anything
        to dmuond: wrap every micro-batch but the last."""
        old, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = old

    def _check_hyperparameters(self):
        """What the daemon was given must not have changed (lr and weight_decay
        are applied here and may change; equal values in another spelling, e.g.
        a list for a tuple or "original" for None, are fine)."""
        now = _groups.specs(self.param_groups, self._group_of)
        for g, then, spec in zip(sorted(set(self._group_of)), self._opened, now):
            for key in then:
                if spec[key] != then[key]:
                    name = "ns_coefficients" if key in ("schedule", "coefficients") else key
                    raise ValueError(
                        f"DMuon: param_groups[{g}]['{name}'] changed from "
                        f"{then[key]!r} to {spec[key]!r}; dmuond fixes every Muon "
                        "hyperparameter but lr and weight_decay when the optimizer is "
                        "created: create a new DMuon and load_state_dict() into it")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0, self._wait = time.perf_counter(), 0.0
        if getattr(self, "_closed", False):
            raise RuntimeError("DMuon: step() after close()")
        with self._explained():
            self._step()
        self.stats["steps"] += 1
        self.stats["last_wait_seconds"] = self._wait
        self.stats["wait_seconds"] += self._wait
        self.stats["last_step_seconds"] = time.perf_counter() - t0
        return loss

    def _step(self):
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if self._session is not None:
            self.synchronize()  # a step() right after a step(), without backward
            self._check_hyperparameters()
            for i, r in enumerate(self._muon):
                if r.handoff == "step (frozen)" and r.param.requires_grad:
                    self._hook_grad(i)  # unfrozen: hooked from the next backward
                g = self.param_groups[self._group_of[i]]
                self._step_lr[i] = (float(g["lr"]), float(g["weight_decay"]))
                if not self._handed[i]:
                    if r.param.grad is None and self._trained[i]:
                        self._warn_absent(i)
                    self._handoff(i, r.param.grad)
        if self._adamw is not None:
            self._adamw.step()  # runs while dmuond computes
        if self._session is not None:
            self._pending = True
            if not self._overlap_forward:
                self.synchronize()
        self._momentum_cache = None

    def _install_state(self):
        ref = weakref.ref(self)
        for i, r in enumerate(self._muon):
            st = self.state.get(r.param, {})
            if not isinstance(st, _MuonState) or st._index != i:
                self.state[r.param] = _MuonState(ref, i, dict(st))

    def _momentum_buffer(self, i):
        """Muon matrix i's momentum, fetched from dmuond (once per step)."""
        if self._momentum_cache is None:
            self._at_boundary("state[p]['momentum_buffer'] (a read from dmuond)")
            st = self._session.get_state()
            self._momentum_cache = dict(zip(st["names"], st["momentum"]))
        r = self._muon[i]
        m = torch.from_numpy(self._momentum_cache[self._session.names[i]])
        if r.row_range:
            m = m[r.row_range[0]:r.row_range[1]]
        return m.reshape(r.param.shape).to(device=r.param.device, dtype=r.param.dtype,
                                           copy=True)

    def _warn_absent(self, i):
        """A Muon matrix with momentum and no gradient in this step: the
        parameter is left unchanged, as torch.optim.Muon leaves it, but dmuond
        cannot be told "no gradient" (the protocol declares every parameter
        every step), so it gets zeros and its momentum decays (M <- mu * M),
        where torch's stays. Exact while the momentum is zero (a branch or a
        frozen parameter that has not trained yet)."""
        if i in self._warned_absent:
            return
        self._warned_absent.add(i)
        warnings.warn(
            f"DMuon: {self._muon[i].name} has no gradient in step {self._session.step}; "
            "it is left unchanged as torch.optim.Muon leaves it, but dmuond gets zeros "
            "for it, so its momentum decays by `momentum` where torch.optim.Muon's "
            "stays (the dmuond protocol cannot yet say 'no gradient'). Said once per "
            "parameter", RuntimeWarning, stacklevel=3)

    def _where(self):
        if self._session is None:
            return ""
        who = "private dmuond" if self._daemon is not None else "dmuond"
        return f"{who} at {self.address} ({self.transport})"

    def _explain(self, e):
        """e, or, when the private dmuond (server="auto") has died, an
        UnavailableError that names it, how it ended, its log's tail and what
        to do next."""
        d = self._daemon
        if d is None or getattr(e, "explained", False):
            return e
        try:
            d.process.wait(timeout=0.5)  # its sockets close just before it is reaped
        except Exception:  # noqa: BLE001 - still running (or not our child)
            pass
        if d.alive():
            return e
        rc = d.process.returncode
        if rc < 0:
            try:
                how = f"was killed by signal {signal.Signals(-rc).name} ({-rc})"
            except ValueError:
                how = f"was killed by signal {-rc}"
        else:
            how = f"exited with status {rc}"
        hint = (" (SIGKILL from outside: often the kernel's OOM killer, see `dmesg`)"
                if rc == -signal.SIGKILL else "")
        tail = "\n".join("    " + line for line in d.log_tail(10).splitlines())
        err = _native.load().UnavailableError(
            f"DMuon: the private dmuond (pid {d.pid}, {d.binary}, at {d.address}, "
            f"started by server='auto') {how}{hint}; the Muon momentum it held is "
            f"gone with it. The last lines of its log ({d.log_path}):\n{tail}\n"
            "Next: create a new DMuon (it starts a new private dmuond) and "
            "load_state_dict() your last checkpoint, or run dmuond yourself and pass "
            f"server='host:port'. (The client's error: {e})")
        err.code, err.explained = "UNAVAILABLE", True
        return err

    # ----------------------------------------------------------------- state
    def _at_boundary(self, what):
        self.synchronize()
        if self._session is not None and any(self._handed):
            raise RuntimeError(f"DMuon.{what}() in the middle of a step (gradients are "
                               "already with dmuond): call it after step()")

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict (AdamW's state, every group) plus "dmuon": the
        daemon-held Muon momentum. Raises dmuon.Error naming the daemon if it
        cannot be fetched; local_state_dict() is the rest without it."""
        try:
            self._at_boundary("state_dict")
            sd = self.local_state_dict()
            if self._session is not None:
                st = self._session.get_state()
                sd["dmuon"] = {
                    "format": 1,
                    "completed_steps": int(st["completed_steps"]),
                    "momentum": {n: torch.from_numpy(m)
                                 for n, m in zip(st["names"], st["momentum"])},
                }
            return sd
        except _native.load().Error as e:
            err = self._explain(e)
            raise type(err)(
                f"DMuon.state_dict(): the Muon momentum is held by dmuond at "
                f"{self.address} and could not be fetched: {err}\nTo save what this "
                "process holds (AdamW's state and the parameter groups; Muon momentum "
                "restarts from zero when it is loaded), use opt.local_state_dict()."
            ) from e

    def local_state_dict(self) -> dict[str, Any]:
        """The state this process holds: AdamW's state and every parameter
        group, without dmuond's Muon momentum (state_dict() has it). For when
        dmuond is gone; load_state_dict() of it warns that the Muon momentum
        starts from zero."""
        sd = super().state_dict()
        sd["state"] = {k: dict(v) for k, v in sd["state"].items() if v}
        return sd

    def _check_loadable(self, state_dict):
        """Everything load_state_dict() checks, before it changes anything."""
        saved = state_dict.get("param_groups")
        if not isinstance(saved, list) or "state" not in state_dict:
            raise ValueError("DMuon.load_state_dict: not an optimizer state_dict (it "
                             "needs 'state' and 'param_groups')")
        if len(saved) != len(self.param_groups):
            raise ValueError(
                f"DMuon.load_state_dict: the checkpoint has {len(saved)} parameter "
                f"groups, this optimizer {len(self.param_groups)} (each user group is a "
                "Muon and an AdamW group): create the DMuon with the same params/groups, "
                "model, adamw= and muon= as the one that saved it")
        for g, (mine, theirs) in enumerate(zip(self.param_groups, saved)):
            if len(mine["params"]) != len(theirs.get("params", ())):
                raise ValueError(
                    f"DMuon.load_state_dict: param_groups[{g}] has "
                    f"{len(theirs.get('params', ()))} parameters in the checkpoint and "
                    f"{len(mine['params'])} here: the routing differs (check adamw=, "
                    "muon=, the groups, and which parameters exist)")
            if bool(theirs.get("use_muon", mine["use_muon"])) != mine["use_muon"]:
                kind = {True: "a Muon", False: "an AdamW"}
                raise ValueError(
                    f"DMuon.load_state_dict: param_groups[{g}] is "
                    f"{kind[bool(theirs['use_muon'])]} group in the checkpoint and "
                    f"{kind[mine['use_muon']]} group here: the routing differs (check "
                    "adamw=, muon= and the groups' use_muon)")
        if self._session is None:
            return None
        merged = [{**mine, **{k: v for k, v in theirs.items() if k != "params"}}
                  for mine, theirs in zip(self.param_groups, saved)]
        try:
            now = _groups.specs(merged, self._group_of)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"DMuon.load_state_dict: the checkpoint's Muon groups "
                             f"cannot be read ({e!r})") from e
        for g, then, spec in zip(sorted(set(self._group_of)), self._opened, now):
            for key in then:
                if spec[key] != then[key]:
                    name = "ns_coefficients" if key in ("schedule", "coefficients") else key
                    raise ValueError(
                        f"DMuon.load_state_dict: the checkpoint's param_groups[{g}]"
                        f"['{name}'] is {merged[g][name]!r}; this optimizer's dmuond "
                        f"session was opened with {self.param_groups[g][name]!r}, and "
                        f"dmuond fixes it at creation: create the DMuon with "
                        f"{name}={merged[g][name]!r}, then load_state_dict()")
        dm = state_dict.get("dmuon")
        if dm is None:
            return None
        if dm.get("format") != 1 or not isinstance(dm.get("momentum"), Mapping):
            raise ValueError(f"DMuon.load_state_dict: unknown 'dmuon' format "
                             f"{dm.get('format')!r} (this DMuon reads format 1)")
        names, momentum = self._session.names, []
        for r, name in zip(self._muon, names):
            m = dm["momentum"].get(name)
            if m is None:
                raise ValueError(
                    f"DMuon.load_state_dict: no momentum for {name!r} in the checkpoint "
                    f"(it has {sorted(dm['momentum'])}): the model or its routing differs "
                    "(check adamw= and muon=)")
            if tuple(m.shape) != tuple(r.matrix):
                raise ValueError(f"DMuon.load_state_dict: momentum of {name!r} is "
                                 f"{list(m.shape)}; the parameter's matrix is {list(r.matrix)}")
            momentum.append(m.detach().to("cpu", torch.float32).contiguous().numpy())
        return {"completed_steps": int(dm["completed_steps"]), "names": names,
                "momentum": momentum}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Checks everything first (param_groups and the daemon are untouched
        when it raises; the error names what to change), then loads AdamW's
        state and the groups here and the Muon momentum into dmuond."""
        self._at_boundary("load_state_dict")
        daemon_state = self._check_loadable(state_dict)
        if self._session is not None and daemon_state is None:
            warnings.warn("DMuon.load_state_dict: no dmuond momentum in this state_dict; "
                          "Muon momentum starts from zero", RuntimeWarning)
        if daemon_state is not None:
            self._session.set_state(daemon_state)  # first: it can still fail
            self._trained = [bool(m.any()) for m in daemon_state["momentum"]]
            self._momentum_cache = None
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "dmuon"})
        self._relink_adamw()
        self._install_state()
        if self._session is not None:
            _ddp.barrier(self._pg)

    # ------------------------------------------------------------ reporting
    @property
    def routing(self) -> list[dict[str, Any]]:
        """Where every parameter went: a list of dicts (name, shape, route, ...;
        layer: a Muon matrix's layer in the daemon's table, else None)."""
        return [dict(name=r.name, shape=r.shape, route=r.route, reason=r.reason,
                     matrix=r.matrix, sharding=r.sharding if r.route == "muon" else None,
                     handoff=r.handoff or None, layer=r.layer) for r in self._routes]

    @property
    def routing_table(self) -> str:
        table = _routing.format_table(self._routes)
        return f"{table}\ntransport to dmuond: {self.transport}" if self._session else table

    @property
    def session(self) -> Session | None:
        return self._session

    @property
    def transport(self) -> str | None:
        """How the Muon tensors travel: "cuda_ipc" | "nccl" | "shm" | "inline",
        with the reason when CUDA tensors are staged through host memory."""
        if self._session is None:
            return None
        t = self._session.transport
        return f"{t} ({self._staging})" if self._staging else t

    def close(self) -> None:
        """Closes the dmuond session and stops a private dmuond."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._closed = True
        self._session, self._grad, self._upd, self._region = None, None, None, None
        if self._finalizer is not None:
            self._finalizer()

"""dmuon.optim.DMuon: torch.optim.Muon's semantics, computed by dmuond.

    from dmuon import RoutingOptions
    from dmuon.optim import DMuon
    opt = DMuon(model, lr=0.02, weight_decay=0.01,
                routing_options=RoutingOptions(adamw=[model.lm_head]))

Every matrix (2-D weight, or conv weight flattened to out x in*k*k) is handed
to dmuond, which owns its momentum and returns lr_scale(A, B) * NS(U) with
U the (Nesterov) momentum step; this side applies

    W <- W * (1 - lr * weight_decay) - lr * update

which is torch.optim.Muon's `param.mul_(1 - lr * wd); param.add_(O,
alpha=-lr * lr_scale)` with lr_scale folded into the update (the same
numbers up to one fp32 rounding of the product). Every other parameter is
updated here by torch.optim.AdamW (adamw_options=AdamWOptions(lr, betas,
eps, weight_decay)). See client/python/README.md for routing, overlap,
accumulation, state_dict, DDP and errors.

DMuon is the torch.optim.Optimizer surface; its machinery lives in objects
it owns (docs/design.md, "The Python client"): the MuonTable (_table), the
Handoff of each step's gradients and updates (_handoff, with its session
Link, Hooks and Recovery) and the StateView of the Muon state (_state);
_options holds the option groups and _errors explains a dead private
daemon.

(This module was dmuon.torch, a name that shadowed `torch` inside the
package; dmuon.torch still imports as an alias of it.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import ParamsT

from . import Session, _convert, _ddp, _dtensor, _errors, _groups, _native, _options
from . import _parts, _routing, _session, _table, _wiring
from ._groups import CLASSIC
from ._handoff import Handoff
from ._options import AdamWOptions, DaemonOptions, OverlapOptions, RoutingOptions
from ._recovery import Recovery, deferred_sigint
from ._state import StateView, _MuonState
from ._table import MuonTable
from ._wiring import _DDP

try:
    from torch.distributed import ProcessGroup
except ImportError:  # torch built without distributed
    if not TYPE_CHECKING:
        ProcessGroup = Any

# ns_coefficients: one (a, b, c) triple for every step, a list of per-step
# triples, or a named schedule ("classic", "polar_express", "you").
NSCoefficients = tuple[float, float, float] | Sequence[Sequence[float]] | str


def _compiled_autograd() -> bool:
    try:
        import torch._dynamo.compiled_autograd as ca
        import torch._dynamo.config as dynamo_config
    except ImportError:
        return False
    return bool(getattr(dynamo_config, "compiled_autograd", False)
                or getattr(ca, "compiled_autograd_enabled", False))


def _check_hyperparameters(lr, weight_decay, momentum, use_addmm, adjust_lr_fn):
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
    if adjust_lr_fn not in _groups.ADJUST_LR_FNS:
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")


def _with_model(params, routing: RoutingOptions, overlap: OverlapOptions):
    """(params, routing with its model and its selectors as lists, the DDP
    wrapper or None, the model to route by and hook, or None), checked."""
    model = routing.model
    if isinstance(params, nn.Module):
        if model is not None and model is not params:
            raise ValueError("DMuon: params is a model and RoutingOptions(model=) names "
                             "another one")
        model, params = params, list(params.parameters())
    routing = dataclasses.replace(
        routing, model=model, adamw=list(routing.adamw), muon=list(routing.muon),
        experts=_parts.normalize(routing.experts), split=dict(routing.split or {}))
    ddp = model if isinstance(model, _DDP) else None
    module = ddp.module if ddp is not None else model
    if overlap.forward and module is None:
        raise ValueError("DMuon: OverlapOptions(forward=True) needs the model (pass it "
                         "as params or as RoutingOptions(model=)) to hook its modules' "
                         "forward")
    if overlap.backward and _compiled_autograd():
        raise ValueError(
            "DMuon: compiled autograd is on (torch._dynamo.config.compiled_autograd"
            "=True): it traces backward's hooks into a graph, and DMuon's overlap "
            "hooks hand each gradient to dmuond (I/O) as backward makes it. Pass "
            "overlap_options=OverlapOptions(backward=False) (gradients are handed over "
            "in step(); compiled autograd then works), or turn compiled autograd off")
    return params, routing, ddp, module


class DMuon(torch.optim.Optimizer):
    """Muon through dmuond (matrices) plus a local AdamW (everything else).

    params: a model (nn.Module, DDP included: best, names and embeddings are
    known), an iterable of parameters, of (name, parameter) pairs, or of
    parameter-group dicts (which may override any hyperparameter below,
    adamw_* included, and may say "use_muon": True/False), checked as
    torch.optim.Optimizer checks them.
    The positional parameters are torch.optim.Muon's, in its order and with
    its defaults: lr (a float or a 1-element tensor), weight_decay, momentum,
    nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn (None/"original",
    "match_rms_adamw" or "spectral_unclamped"). Everything after them is
    keyword-only and DMuon's own: use_addmm (accepted so calls written for
    torch versions whose Muon has it work unchanged; it picks how torch forms
    the same products, and dmuond's kernels make that choice themselves),
    method ("direct", "gram", "auto"), the option groups below (dmuon/
    _options.py has each field), process_group (the ranks of one job;
    default: torch.distributed's world) and verbose (print every
    parameter's route).
    adamw_options: AdamWOptions(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.01), the AdamW half's hyperparameters (torch.optim.AdamW's
    names and defaults).
    daemon_options: DaemonOptions(server="auto", transport="auto",
    timeout=60.0, job_id=None, flags=(), resume="fresh"): which dmuond and
    how to reach it. server: "auto" (a private dmuond for this process, or
    for the process group, stopped with the optimizer), "host:port" of a
    running dmuond, or a list of addresses (a pool: each matrix goes to one
    of its daemons, by a plan rank 0 makes; see pool_owner). resume:
    "fresh" (default; False too) starts the job at step 1 and raises if
    job_id names a job dmuond holds momentum of; True (or "continue")
    continues that momentum; "replace" discards it; "auto" continues if
    there is any. load_state_dict() replaces the momentum whatever the mode.
    routing_options: RoutingOptions(model=None, adamw=(), muon=(),
    experts=(), split=None, shards=None): the model to route by, parameters
    sent to AdamW or Muon whatever the rules say, MoE expert stacks and
    fused weights orthogonalized as parts (dmuon/_parts.py), row shards.
    overlap_options: OverlapOptions(backward=True, forward=False,
    reduce_in_daemon=False): gradients handed over during backward, updates
    applied by the next forward, DDP's Muon gradients averaged by dmuond.
    The flat keywords of each group (adamw_lr, ..., server, ..., model,
    adamw, muon, experts, split, shards, overlap, overlap_forward,
    reduce_in_daemon) still work for one release, each with a
    DeprecationWarning naming its new spelling; one left at None takes the
    group's default; one given with its group's options is a TypeError.
    """

    @_options.accepts_flat_keywords
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
        adamw_options: AdamWOptions | None = None,
        daemon_options: DaemonOptions | None = None,
        routing_options: RoutingOptions | None = None,
        overlap_options: OverlapOptions | None = None,
        process_group: ProcessGroup | None = None,
        verbose: bool = False,
    ) -> None:
        aw, dd, ro, oo = _options.grouped(
            dict(adamw_options=adamw_options, daemon_options=daemon_options,
                 routing_options=routing_options, overlap_options=overlap_options))
        resume = _options.resume_mode(dd.resume)
        _check_hyperparameters(lr, weight_decay, momentum, use_addmm, adjust_lr_fn)
        params, ro, self._ddp, module = _with_model(params, ro, oo)
        groups, named = _groups.user_groups(params)
        self._routing, self._overlap, self._server = ro, oo, dd.server
        self._module, self._user_groups, self._named = module, len(groups), bool(named)
        routes = _table.route(groups, named, module, ro, ro.shards)
        link = _session.Link(*_ddp.world(process_group), dd.timeout, dd.transport)
        _dtensor.check(routes, link.pg, link.world, oo.forward)  # FSDP2 / TP
        self._shared = dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                            nesterov=nesterov, ns_coefficients=ns_coefficients, eps=eps,
                            ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, method=method,
                            adamw_lr=aw.lr, adamw_betas=aw.betas, adamw_eps=aw.eps,
                            adamw_wd=aw.weight_decay)
        torch_groups, group_of = _groups.split(groups, routes, self._shared)
        self._constructing, self._closed = True, False
        super().__init__(torch_groups, dict(lr=lr, weight_decay=weight_decay))
        # OneCycleLR/CyclicLR(cycle_momentum=True) need it (set after the
        # groups: AdamW's have none); each group's is then its own, sent to
        # dmuond (Muon) or its beta1 (AdamW: _groups.adamw_beta1).
        self.defaults["momentum"] = momentum
        self._constructing, self._adamw = False, None
        self._relink_adamw()
        self._handoff = self._new_handoff(routes, group_of, link, resume)
        self.stats = self._handoff.stats
        if self._table.muon:
            self._handoff.open(dd.server, dd.job_id, dd.flags, module, resume)
        self._muon_state = StateView(self._handoff)  # opt.state's Muon half, checks
        self._muon_state.install(self.state)
        if link.rank == 0:
            print(self.routing_table if verbose else _routing.format_summary(
                routes, self.param_groups, link.where()),
                file=sys.stdout if verbose else sys.stderr, flush=True)

    def _new_handoff(self, routes, group_of, link, resume):
        """The hand-off of a new optimizer: dmuond's table (a parameter with
        parts, dmuon/_parts.py, is one entry per part) with its hand-off
        plan (_wiring.plan)."""
        entries, group_of = _parts.expand([r for r in routes if r.route == "muon"],
                                          group_of)
        oo = self._overlap
        _wiring.plan(entries, self._ddp, link.world, oo.reduce_in_daemon, oo.backward,
                     self._module)
        table = MuonTable(routes, entries, group_of, _groups.specs(self.param_groups, group_of))
        return Handoff(table, self.param_groups, link, Recovery(resume), ddp=self._ddp,
                       overlap=oo.backward, overlap_forward=oo.forward)

    @property
    def _table(self) -> MuonTable:
        return self._handoff.table

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
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        self._handoff.at_boundary("add_param_group")
        groups, named = _groups.user_groups([param_group])
        _groups.check_names(bool(named), self._named)
        known = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in known for p in groups[0]["params"]):
            raise ValueError("some parameters appear in more than one parameter group")
        routes = _table.route(groups, named, self._module, self._routing, strict=False)
        torch_groups, group_of = _groups.split(groups, routes, self._shared)
        for r in routes:
            r.group = self._user_groups
            if r.name.startswith("params[0]["):
                r.name = f"params[{self._user_groups}][" + r.name[len("params[0]["):]
        new_muon, group_of = _parts.expand([r for r in routes if r.route == "muon"],
                                           group_of)
        world = self._handoff.world
        if new_muon and world > 1:
            raise NotImplementedError(
                "DMuon.add_param_group: new Muon matrices reopen the dmuond session, "
                "which needs every rank at once; with torch.distributed, create the "
                "DMuon with every group (or add only AdamW parameters: use_muon=False)")
        if new_muon:  # one rank (above): DTensor refusals, no collective
            _dtensor.check(routes, self._handoff.pg, world, self._handoff.overlap_forward)
        base = len(self.param_groups)
        for g in torch_groups:
            super().add_param_group(g)
        self._user_groups += 1
        self._relink_adamw()
        table = self._table.grown(routes, new_muon, [base + g for g in group_of],
                                  self.param_groups, self._replan)
        if new_muon:
            self._handoff.grow(table, self._server, self._module)
            self._muon_state.install(self.state)
        else:
            self._handoff.table = table

    def _replan(self, entries):
        """The hand-off plan of a grown table (MuonTable.grown): the entries
        it had keep their hand-off (their hooks are in place)."""
        kept = [r.handoff for r in self._table.muon]
        _wiring.plan(entries, self._ddp, self._handoff.world,
                     self._overlap.reduce_in_daemon, self._overlap.backward, self._module)
        for r, handoff in zip(entries, kept):
            r.handoff = handoff

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

    # ------------------------------------------------------------- per step
    def synchronize(self) -> None:
        """Applies every outstanding update of the last step (overlap_forward;
        or of a step() that an interrupt cut short after it committed)."""
        self._handoff.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad, after settling a step an interrupt cut short
        (rolled back before its commit, completed after: client/python/
        README.md, "Interrupts and exceptions")."""
        try:
            self._handoff.settle()
        except _native.load().Error:
            # The private dmuond died: nothing can complete the step, its
            # error was raised where it happened, and state_dict() repeats it
            # with what to do. zero_grad itself does not fail, as torch's.
            daemon = self._handoff.link.daemon
            if daemon is None or daemon.alive():
                raise
        super().zero_grad(set_to_none)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate into .grad without handing anything
        to dmuond: wrap every micro-batch but the last."""
        h = self._handoff
        old, h.accumulating = h.accumulating, True
        try:
            yield
        finally:
            h.accumulating = old

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        h = self._handoff
        t0, h.wait = time.perf_counter(), 0.0
        if self._closed:
            raise RuntimeError("DMuon: step() after close()")
        with _errors.explained(h.link.daemon):
            self._step(h)
        self.stats["steps"] += 1
        self.stats["last_wait_seconds"] = h.wait
        self.stats["wait_seconds"] += h.wait
        self.stats["last_step_seconds"] = time.perf_counter() - t0
        return loss

    def _step(self, h):
        if not h.at_step():
            # torch.distributed.checkpoint's _init_optim_state (zero gradients,
            # lr 0): AdamW's state only, no dmuond step (dmuon/_dcp.py)
            if self._adamw is not None:
                self._adamw.step()
            self._muon_state.forget()
            return
        # AdamW's step and the commit run whole: a Ctrl-C in them is raised
        # after the commit (the step is then completed, not undone).
        _groups.adamw_beta1(self.param_groups)  # a cycled 'momentum' is AdamW's beta1
        with deferred_sigint():
            if self._adamw is not None:
                self._adamw.step()  # runs while dmuond computes
            h.commit()
        h.after_commit()
        self._muon_state.forget()

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Muon + AdamW's state_dict, whoever asks (torch.save,
        torch.distributed.checkpoint): every Muon parameter's momentum as
        state[k]["momentum_buffer"] (dmuond's, fp32) and its "step", AdamW's
        state, every group, and "dmuon": {"format": 2, "completed_steps"}
        (dmuon/_state.py). Raises dmuon.Error naming the daemon if the
        momentum cannot be fetched; local_state_dict() is the rest without it."""
        try:
            self._handoff.at_boundary("state_dict")
            self._muon_state.init_adamw_state(self.state)  # a destination for dcp.load
            sd = self.local_state_dict()
            if self.session is not None:
                self._muon_state.add_muon_state(sd)
            return sd
        except _native.load().Error as e:
            err = _errors.explain(self._handoff.link.daemon, e)
            raise type(err)(
                f"DMuon.state_dict(): the Muon momentum is held by dmuond at "
                f"{self.address} and could not be fetched: {err}\nTo save what this "
                "process holds (AdamW's state and the parameter groups; Muon momentum "
                "restarts from zero when it is loaded), use opt.local_state_dict()."
            ) from e

    def local_state_dict(self) -> dict[str, Any]:
        """The state this process holds: AdamW's state and every parameter
        group, without dmuond's Muon momentum and step (state_dict() has
        them). For when dmuond is gone; load_state_dict() of it warns that
        the Muon momentum starts from zero."""
        sd = super().state_dict()
        sd["state"] = {k: v.stored() if isinstance(v, _MuonState) else dict(v)
                       for k, v in sd["state"].items()}
        sd["state"] = {k: v for k, v in sd["state"].items() if v}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Checks everything first (param_groups and the daemon are untouched
        when it raises; the error names what to change), then loads AdamW's
        state and the groups here and the Muon momentum into dmuond. Takes
        state_dict()'s layout, the same without "dmuon" (DCP's,
        torch.optim.Muon's), and format 1 (dmuon/_state.py)."""
        h = self._handoff
        h.at_boundary("load_state_dict")
        daemon_state = self._muon_state.check_loadable(state_dict)
        if self.session is not None and daemon_state is None:
            warnings.warn("DMuon.load_state_dict: no dmuond momentum in this state_dict; "
                          "Muon momentum starts from zero", RuntimeWarning)
        if daemon_state is not None:
            if h.world > 1:
                # dmuond refuses SetState while a GetState of the job is
                # streaming: another rank may still be in the state_dict()
                # before this load (each rank sets the same whole state).
                _ddp.barrier(h.pg)
            self.session.set_state(daemon_state)  # first: it can still fail
            h.trained = [bool(m.any()) for m in daemon_state["momentum"]]
            self._muon_state.forget()
        muon_keys = self._muon_state.muon_keys(state_dict["param_groups"])
        state = {k: ({n: x for n, x in v.items() if n not in ("momentum_buffer", "step")}
                     if k in muon_keys and isinstance(v, Mapping) else v)
                 for k, v in state_dict["state"].items()}
        super().load_state_dict({**{k: v for k, v in state_dict.items() if k != "dmuon"},
                                 "state": state})
        h.groups = self.param_groups  # torch's load_state_dict made new groups
        self._relink_adamw()
        self._muon_state.install(self.state)
        if self.session is not None:
            _ddp.barrier(h.pg)

    def to_torch_state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(torch.optim.Muon's state_dict, torch.optim.AdamW's) of this
        optimizer, for torch optimizers over dmuon.torch_param_groups(self)
        (dmuon/_convert.py; dmuon.to_torch(opt) makes them)."""
        return _convert.to_torch_state_dicts(self)

    def load_torch_state_dicts(self, muon_state_dict: dict[str, Any] | None,
                               adamw_state_dict: dict[str, Any] | None = None, *,
                               muon_params: Sequence[Tensor] | None = None,
                               adamw_params: Sequence[Tensor] | None = None) -> None:
        """Loads torch.optim.Muon's and AdamW's state dicts (Muon momentum
        into dmuond), checked whole before anything changes. muon_params /
        adamw_params: the parameters those optimizers held, in their order
        (default: this DMuon's, as dmuon.torch_param_groups(self) lists them)."""
        _convert.load_torch_state_dicts(self, muon_state_dict, adamw_state_dict,
                                        muon_params=muon_params,
                                        adamw_params=adamw_params)

    # ------------------------------------------------------------ reporting
    @property
    def routing(self) -> list[dict[str, Any]]:
        """Where every parameter went: a list of dicts (name, shape, route, ...;
        layer: a Muon matrix's layer in the daemon's table, else None)."""
        return [dict(name=r.name, shape=r.shape, route=r.route, reason=r.reason,
                     matrix=r.matrix, sharding=r.sharding if r.route == "muon" else None,
                     handoff=r.handoff or None, layer=r.layer) for r in self._table.routes]

    @property
    def routing_table(self) -> str:
        table = _routing.format_table(self._table.routes)
        return f"{table}\ntransport to dmuond: {self.transport}" if self.session else table

    @property
    def session(self) -> Session | None:
        return self._handoff.link.session

    @property
    def transport(self) -> str | None:
        """How the Muon tensors travel: "cuda_ipc" | "nccl" | "shm" | "inline",
        with the reason when CUDA tensors are staged through host memory."""
        return self._handoff.link.transport

    @property
    def address(self) -> str | list[str] | None:
        """dmuond's address (a pool's: its addresses), None without Muon
        parameters."""
        return self._handoff.link.address

    @property
    def job_id(self) -> str | None:
        """The job's name on dmuond (the ranks agree on rank 0's)."""
        return self._handoff.link.job_id

    @property
    def pool_owner(self) -> list[int] | None:
        """A pool: the daemon (index into server) of each Muon table entry,
        the same on every rank (rank 0's plan); None for a single daemon."""
        return self._handoff.link.pool_owner

    def close(self) -> None:
        """Closes the dmuond session and stops a private dmuond."""
        self._closed = True
        self._handoff.close()

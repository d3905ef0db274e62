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
it owns (docs/design.md, "The Python client"): the Layout of its
parameters into groups and dmuond's table (_layout), the MuonTable
(_table), the Handoff of each step's gradients and updates (_handoff, with
its session Link, Hooks and Recovery), the AdamWHalf that updates the rest
(_adamw) and the StateView of the Muon state (_state); _options holds the
option groups and _errors explains a dead private daemon.

(This module was dmuon.torch, a name that shadowed `torch` inside the
package; dmuon.torch still imports as an alias of it.)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import _native

_native.require_torch("dmuon.optim")
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.optim.optimizer import ParamsT  # noqa: E402

from . import Session, _convert, _ddp, _dtensor, _errors, _groups, _options, _routing
from . import _session, _state
from ._adamw import AdamWHalf
from ._groups import CLASSIC
from ._handoff import Handoff
from ._layout import Layout
from ._marks import Marks
from ._options import AdamWOptions, DaemonOptions, OverlapOptions, RoutingOptions
from ._recovery import Recovery
from ._state import StateView
from ._table import MuonTable

try:
    from torch.distributed import ProcessGroup
except ImportError:  # torch built without distributed
    if not TYPE_CHECKING:
        ProcessGroup = Any

# ns_coefficients: one (a, b, c) triple for every step, a list of per-step
# triples, or a named schedule ("classic", "polar_express", "you").
NSCoefficients = tuple[float, float, float] | Sequence[Sequence[float]] | str


class DMuon(torch.optim.Optimizer):
    """Muon through dmuond (matrices) plus a local AdamW (everything else).

    params: a model (nn.Module, DDP included: best, names and embeddings are
    known), an iterable of parameters, of (name, parameter) pairs (each
    group keeps their names as "param_names", as torch's), or of
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
    default: torch.distributed's world), verbose (print every
    parameter's route) and strict (below).
    strict: raise instead of taking any fallback, a path slower than or
    other than the one asked for (a RuntimeError naming it and what to
    change; dmuon/_fallbacks.py lists them: host_staging, private_daemon,
    redo, rewind). Without it each is taken, warned once and counted in
    stats["fallbacks"].
    adamw_options: AdamWOptions(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.01), the AdamW half's hyperparameters (torch.optim.AdamW's
    names and defaults).
    daemon_options: DaemonOptions(server="auto", transport="auto",
    timeout=60.0, connect_timeout=10.0, job_id=None, flags=(), resume="fresh"):
    which dmuond and
    how to reach it. server: "auto" (a private dmuond for this process, or
    for the process group, stopped with the optimizer), "host:port" of a
    running dmuond, or a list of addresses (a pool: each matrix goes to one
    of its daemons, by a plan rank 0 makes; see pool_owner). resume:
    "fresh" (default; False too) starts the job at step 1 and raises if
    job_id names a job dmuond holds momentum of; True (or "continue")
    continues that momentum; "replace" discards it; "auto" continues if
    there is any; an int N continues from exactly completed step N (the
    checkpoint's step), refused unless dmuond holds that step's momentum.
    load_state_dict() replaces the momentum whatever the mode.
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
        strict: bool = False,
    ) -> None:
        aw, dd, ro, oo = _options.grouped(
            dict(adamw_options=adamw_options, daemon_options=daemon_options,
                 routing_options=routing_options, overlap_options=overlap_options))
        resume, strict = _options.resume_mode(dd.resume), _options.strict_mode(strict)
        _groups.check_hyperparameters(lr, weight_decay, momentum, use_addmm, adjust_lr_fn)
        hyper = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                     ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                     adjust_lr_fn=adjust_lr_fn, method=method, adamw_lr=aw.lr,
                     adamw_betas=aw.betas, adamw_eps=aw.eps, adamw_wd=aw.weight_decay)
        layout, groups, named = Layout.of(params, ro, oo, hyper)
        routes = layout.route(groups, named)
        link = _session.Link(*_ddp.world(process_group), dd.timeout, dd.transport,
                             dd.connect_timeout)
        _dtensor.check(routes, link.pg, link.world, oo.forward)  # FSDP2 / TP
        torch_groups, group_of = layout.split(groups, named, routes)
        self._layout, self._constructing, self._closed = layout, True, False
        super().__init__(torch_groups, dict(lr=lr, weight_decay=weight_decay))
        # OneCycleLR/CyclicLR(cycle_momentum=True) need it (set after the
        # groups: AdamW's have none); each group's is then its own, sent to
        # dmuond (Muon) or its beta1 (AdamW: _groups.adamw_beta1).
        self.defaults["momentum"] = momentum
        self._constructing = False
        self._adamw = AdamWHalf(self.param_groups, self.state)
        table = layout.table(routes, group_of, self.param_groups, link.world)
        self._handoff = h = Handoff(table, self.param_groups, link, Recovery(resume),
                                    ddp=layout.ddp, module=layout.module, server=dd.server,
                                    overlap=oo.backward, overlap_forward=oo.forward, strict=strict)
        self.stats, self._marks = h.stats, Marks(h, dd.checkpoint_momentum)  # checked first
        if table.muon:
            self._handoff.open(dd.job_id, dd.flags, resume)
        self._muon_state = StateView(self._handoff, self._marks)  # opt.state's Muon half
        self._muon_state.install(self.state)
        if link.rank == 0:
            print(self.routing_table if verbose else _routing.format_summary(
                routes, self.param_groups, link.where()),
                file=sys.stdout if verbose else sys.stderr, flush=True)

    @property
    def _table(self) -> MuonTable:
        return self._handoff.table

    # ----------------------------------------------------------- construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a user parameter group, routed as at construction (the
        model, RoutingOptions' adamw and muon; the construction's
        hyperparameters are its defaults).
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
        h = self._handoff
        h.at_boundary("add_param_group")
        new = self._layout.new_group(param_group, self.param_groups, h.pg, h.world)
        base = len(self.param_groups)
        for g in new.torch_groups:
            super().add_param_group(g)
        self._adamw.relink(self.param_groups, self.state)
        table = self._layout.add(h.table, new, base, self.param_groups, h.world)
        if new.muon:
            h.grow(table)
            self._muon_state.install(self.state)
        else:
            h.table = table

    # ------------------------------------------------------------- per step
    def synchronize(self) -> None:
        """Applies every outstanding update of the last step (overlap_forward;
        or of a step() that an interrupt cut short after it committed)."""
        self._handoff.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad, after settling a step an interrupt cut short
        (rolled back before its commit, completed after: client/python/
        README.md, "Interrupts and exceptions")."""
        self._handoff.settle()
        super().zero_grad(set_to_none)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate into .grad without handing anything
        to dmuond: wrap every micro-batch but the last."""
        return self._handoff.no_sync()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        h = self._handoff
        with h.timed_step():
            if self._closed:
                raise RuntimeError("DMuon: step() after close()")
            self._muon_state.check_resumed_adamw(self.state, self.param_groups)
            with _errors.explained(h.link):
                h.step(self._adamw.step)  # AdamW's runs while dmuond computes
                self._muon_state.forget()
        return loss

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Muon + AdamW's state_dict, whoever asks (torch.save,
        torch.distributed.checkpoint): every Muon parameter's momentum as
        state[k]["momentum_buffer"] (dmuond's, fp32) and its "step", AdamW's
        state, every group, and "dmuon": {"format": 2, "completed_steps"}
        (dmuon/_state.py). Rank 0 marks the step on dmuond first (once per
        step: mark()); DaemonOptions(checkpoint_momentum="reference"): no
        momentum_buffer, and "dmuon" names the mark ("momentum_ref"). Raises
        dmuon.Error naming the daemon if the momentum cannot be fetched;
        local_state_dict() is the rest without it."""
        link = self._handoff.link
        with _errors.fetching_momentum(link):
            self._handoff.at_boundary("state_dict")
            self._muon_state.init_adamw_state(self.state)  # a destination for dcp.load
            sd = self.local_state_dict()
        if self.session is not None:
            # A reference checkpoint's refused mark is its own error; in
            # full mode a lost daemon says the momentum cannot be fetched.
            with (_errors.explained(link) if self._marks.mode == "reference"
                  else _errors.fetching_momentum(link)):
                self._marks.auto_mark()
            with _errors.fetching_momentum(link):
                self._muon_state.add_muon_state(sd, reference=self._marks.reference())
        return sd

    def mark(self) -> int:
        """Asks dmuond to keep the momentum of the step the job is at (a
        mark), so that a trainer restarted from this step's model weights,
        at any world size, continues exactly with DaemonOptions(job_id=...,
        resume=step) (dmuon/_marks.py). Between steps, on every rank (rank 0
        asks dmuond; the others get its answer). Returns the step marked.
        state_dict() marks its step itself."""
        with _errors.explained(self._handoff.link):
            return self._marks.mark()

    def local_state_dict(self) -> dict[str, Any]:
        """The state this process holds: AdamW's state and every parameter
        group, without dmuond's Muon momentum and step (state_dict() has
        them). For when dmuond is gone, or keeps the momentum itself
        (--state-dir): load_state_dict() of it leaves dmuond's momentum as it
        is, and warns when dmuond holds none (Muon starts from zero) or
        another step's than the checkpoint's AdamW state."""
        return _state.local_state_dict(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Checks everything first (param_groups and the daemon are untouched
        when it raises; the error names what to change), then loads AdamW's
        state and the groups here and the Muon momentum into dmuond. Takes
        state_dict()'s layout, the same without "dmuon" (DCP's,
        torch.optim.Muon's), and format 1 (dmuon/_state.py)."""
        h = self._handoff
        h.at_boundary("load_state_dict")
        super().load_state_dict(self._muon_state.load(state_dict))
        h.groups = self.param_groups  # torch's load_state_dict made new groups
        self._adamw.relink(self.param_groups, self.state)
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
        return self._table.report()

    @property
    def routing_table(self) -> str:
        table = _routing.format_table(self._table.routes)
        if not self.session:
            return table
        return (f"{table}\ntransport to dmuond: {self.transport}\n"
                f"job on dmuond: '{self.job_id}' (opt.job_id; pass it as "
                f"DaemonOptions(job_id=) to reopen this job's momentum)")

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

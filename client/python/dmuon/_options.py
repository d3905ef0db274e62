"""DMuon's grouped options: AdamWOptions (the AdamW half's hyperparameters),
DaemonOptions (which dmuond, and how to reach it), RoutingOptions (which
parameters go to dmuond, and as what) and OverlapOptions (when gradients
leave and updates come back).

    opt = DMuon(model, lr=0.02, weight_decay=0.01,
                adamw_options=AdamWOptions(lr=3e-3, betas=(0.9, 0.95)),
                daemon_options=DaemonOptions("10.0.0.5:50051", timeout=120),
                routing_options=RoutingOptions(adamw=[model.lm_head]),
                overlap_options=OverlapOptions(forward=True))

Each group stands for some of DMuon's flat keywords, which still work for
one release, each with a DeprecationWarning naming its new spelling:

    adamw_lr, adamw_betas, adamw_eps, adamw_wd  AdamWOptions(lr, betas, eps, weight_decay)
    server, transport, timeout, job_id,         DaemonOptions(server, transport=, timeout=,
    daemon_flags, resume                                      job_id=, flags=, resume=)
    model, adamw, muon, experts, split, shards  RoutingOptions(model, adamw, muon, experts,
                                                               split, shards)
    overlap, overlap_forward, reduce_in_daemon  OverlapOptions(backward, forward,
                                                               reduce_in_daemon)

A call gives a value one way: a flat keyword of a group together with that
group's options object is a TypeError naming both. Torch-free (dmuon
imports it without torch).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor, nn

    # Parameters, modules (all their parameters) or names.
    ParamSelector = Iterable[Tensor | nn.Module | str]


@dataclasses.dataclass(frozen=True)
class AdamWOptions:
    """The hyperparameters of the AdamW half (every parameter that is not a
    Muon matrix), named, ordered and defaulted as torch.optim.AdamW's (the
    flat keywords: adamw_lr, adamw_betas, adamw_eps, adamw_wd). A parameter
    group's "adamw_lr", "adamw_betas", "adamw_eps" and "adamw_wd" keys still
    override them per group."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclasses.dataclass(frozen=True)
class DaemonOptions:
    """Which dmuond holds the Muon matrices and how this process reaches it
    (the flat keywords: server, transport, timeout, job_id, daemon_flags,
    resume).

    server: "auto" ($DMUON_SERVER, else a private dmuond for this process or
    process group), "host:port" of a running dmuond, or a list of addresses (a
    pool). transport: "auto", "shm" (same host) or "inline" (bytes in gRPC).
    timeout: seconds, waiting for any one update. connect_timeout: seconds
    to wait for a dmuond at `server` that does not answer yet (a refused or
    unreachable address fails after it, naming the address and, from
    $DMUON_SERVER, the variable); raise it when trainers may start before
    their daemon. job_id: the
    daemon-side job name (None: a random one; the ranks agree on rank 0's).
    flags: extra dmuond flags for the private daemon of server="auto".
    resume: what the job's momentum on dmuond must be when this DMuon opens
    it (docs/protocol.md "Resume"). "fresh" (or False, the default): start
    at step 1; a job_id whose job has completed a step (in the daemon's
    memory, or in its --state-dir snapshot) is an error naming its step.
    True (or "continue"): continue that job's momentum; an error if it has
    none. "replace": discard its momentum and start at step 1. "auto": the
    protocol 1.0 behaviour, continue if there is momentum, else start. All
    but "auto" need dmuond 1.1 (protocol minor 1) or newer. An int N >= 1:
    continue from exactly completed step N, the step of the checkpoint the
    trainer loads; dmuond holds the momentum of the step the job is at and,
    with --state-dir, of the snapshotted step before it (so a trainer whose
    dmuond was killed after writing a step's snapshot but before the trainer
    got that step's step_complete continues exactly), and refuses any other
    step naming the steps it holds (dmuond 1.4, protocol minor 4); dmuond
    1.5 also holds the steps marked (DMuon.mark(), state_dict()) and resumes
    them at any world size.
    checkpoint_momentum: what state_dict() carries of the Muon momentum.
    "full" (default): dmuond's momentum, as torch.optim.Muon's
    momentum_buffer. "reference": each Muon parameter's "step" only, the
    momentum staying on dmuond as the mark of that step (state_dict() marks
    it), and "dmuon": {"momentum_ref": {"job_id", "step"}}; loading such a
    checkpoint needs this job opened with resume=that step (dmuon/_marks.py).
    """

    server: str | Sequence[str] = "auto"
    _: dataclasses.KW_ONLY
    transport: str = "auto"
    timeout: float = 60.0
    connect_timeout: float = 10.0
    job_id: str | None = None
    flags: Sequence[str] = ()
    resume: bool | str | int = "fresh"
    checkpoint_momentum: str = "full"


@dataclasses.dataclass(frozen=True)
class RoutingOptions:
    """Which parameters go to dmuond, and as what (client/python/README.md,
    "Routing"); the flat keywords: model, adamw, muon, experts, split,
    shards.

    model: the model whose modules and names route the parameters, when
    params is not the model itself (an nn.Module; DDP included). adamw /
    muon: parameters, modules or names sent to AdamW / to Muon whatever the
    rules say. experts: 3-D expert stacks [E, out, in] (parameters, modules
    or names; "auto": 3-D parameters named or owned by an "expert" module),
    each orthogonalized as E matrices out x in with a momentum each. split:
    {parameter or name: n | [rows, ...] | {label: rows}}, a fused 2-D weight
    (QKV) orthogonalized as parts along dim 0. shards: {parameter or name:
    (row_begin, row_end, total_rows)}, a plain tensor holding those rows of
    its matrix on this rank.
    """

    model: nn.Module | None = None
    adamw: ParamSelector = ()
    muon: ParamSelector = ()
    experts: ParamSelector | str = ()
    split: Mapping[Tensor | str, Any] | None = None
    shards: Mapping[Tensor | str, tuple[int, int, int]] | None = None


@dataclasses.dataclass(frozen=True)
class OverlapOptions:
    """When the Muon gradients leave for dmuond and their updates come back
    (client/python/README.md, "Overlap"); the flat keywords: overlap,
    overlap_forward, reduce_in_daemon.

    backward: each gradient is handed to dmuond during backward, as soon as
    it is accumulated (False: all at step(), after any edit of .grad).
    forward: step() returns at once, and each module's forward waits for its
    own parameters' updates (needs the model). reduce_in_daemon: with
    several ranks (DDP), the Muon gradients skip DDP's all-reduce and
    dmuond averages them.
    """

    backward: bool = True
    forward: bool = False
    reduce_in_daemon: bool = False


# Each group's flat keywords, as {flat keyword: field}.
ADAMW_KEYWORDS = {"adamw_lr": "lr", "adamw_betas": "betas", "adamw_eps": "eps",
                  "adamw_wd": "weight_decay"}
DAEMON_KEYWORDS = {"server": "server", "transport": "transport", "timeout": "timeout",
                   "job_id": "job_id", "daemon_flags": "flags", "resume": "resume"}
ROUTING_KEYWORDS = {"model": "model", "adamw": "adamw", "muon": "muon",
                    "experts": "experts", "split": "split", "shards": "shards"}
OVERLAP_KEYWORDS = {"overlap": "backward", "overlap_forward": "forward",
                    "reduce_in_daemon": "reduce_in_daemon"}
# Each options group: (its class, its keyword, its flat keywords).
GROUPS = ((AdamWOptions, "adamw_options", ADAMW_KEYWORDS),
          (DaemonOptions, "daemon_options", DAEMON_KEYWORDS),
          (RoutingOptions, "routing_options", ROUTING_KEYWORDS),
          (OverlapOptions, "overlap_options", OVERLAP_KEYWORDS))
FLAT_KEYWORDS = {k for _, _, fields in GROUPS for k in fields}

# DaemonOptions.resume: each accepted value -> Client.open_session's resume.
RESUME_MODES = {False: "fresh", "fresh": "fresh", True: "continue",
                "continue": "continue", "replace": "replace", "auto": "auto"}


def strict_mode(value: Any) -> bool:
    """DMuon's strict= (dmuon/_fallbacks.py): a bool, else a TypeError, as
    torch.optim checks its flags' types (1 is not True here: a typo such as
    strict="false" must not turn strict mode on)."""
    if not isinstance(value, bool):
        raise TypeError(f"DMuon: strict must be a bool, but got {type(value).__name__}")
    return value


def resume_mode(value: Any) -> str | int:
    """Client.open_session's resume for DMuon's resume= (DaemonOptions.resume):
    a mode, or a completed step (an int >= 1) to continue from exactly; a
    ValueError naming the accepted values for anything else."""
    if isinstance(value, (bool, str)) and value in RESUME_MODES:
        return RESUME_MODES[value]
    if not isinstance(value, (bool, str)):
        try:
            step = operator.index(value)  # an int, numpy's too; never a float
        except TypeError:
            step = 0
        if step >= 1:
            return step
    raise ValueError(
        f"DMuon: DaemonOptions(resume={value!r}) is not one of \"fresh\" (or False, the "
        "default: start the job at step 1), True (or \"continue\": continue its "
        "momentum), \"replace\" (discard its momentum), \"auto\" (continue if any) "
        "or a completed step N >= 1 (continue from exactly step N's momentum)")


def accepts_flat_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """DMuon.__init__ that also takes the deprecated flat keywords (as
    pandas' deprecate_kwarg does): each one given warns (DeprecationWarning)
    naming its new spelling, and its group's options are made of them. The
    signature (inspect, help()) stays the one to use; any other keyword is
    the TypeError Python gives."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        flat = {k: kwargs.pop(k) for k in list(kwargs) if k in FLAT_KEYWORDS}
        for cls, keyword, fields in GROUPS:
            given = {k: v for k, v in flat.items() if k in fields}
            for k in given:
                warnings.warn(
                    f"DMuon({k}=...) is deprecated: pass {keyword}={cls.__name__}("
                    f"{fields[k]}=...) (the flat keyword goes in the next release)",
                    DeprecationWarning, stacklevel=2)
            if given:
                kwargs[keyword] = resolve(cls, keyword, kwargs.get(keyword), given, fields)
        init(self, *args, **kwargs)

    return wrapper


def grouped(options: dict[str, Any]) -> list[Any]:
    """The four options groups of a DMuon() call, in GROUPS' order, from
    options ({keyword: value or None}): each as given, or its defaults."""
    return [resolve(cls, keyword, options.get(keyword), {}, fields)
            for cls, keyword, fields in GROUPS]


def resolve(cls: type, keyword: str, options: Any, flat: dict[str, Any],
            fields: dict[str, str]) -> Any:
    """The options of one group: `options` (given as `keyword=`), or a `cls`
    made of the flat keywords given (None: not given, the field's default).
    Both at once is a TypeError naming both."""
    given = [k for k in fields if flat.get(k) is not None]
    if options is None:
        return cls(**{fields[k]: flat[k] for k in given})
    if given:
        raise TypeError(
            f"DMuon() got both {given[0]}= and {keyword}=; give "
            f"{fields[given[0]]}= inside {cls.__name__}(...) or drop {keyword}=")
    if not isinstance(options, cls):
        raise TypeError(f"DMuon(): {keyword}= must be a dmuon.{cls.__name__}, not "
                        f"{type(options).__name__} (a dict d: {cls.__name__}(**d))")
    return options

"""DMuon's grouped options: AdamWOptions (the AdamW half's hyperparameters)
and DaemonOptions (which dmuond, and how to reach it).

    opt = DMuon(model, lr=0.02, weight_decay=0.01, adamw=[model.lm_head],
                adamw_options=AdamWOptions(lr=3e-3, betas=(0.9, 0.95)),
                daemon_options=DaemonOptions("10.0.0.5:50051", timeout=120))

Each group stands for a few of DMuon's flat keywords, which keep working:

    adamw_lr, adamw_betas, adamw_eps, adamw_wd  AdamWOptions(lr, betas, eps, weight_decay)
    server, transport, timeout, job_id,         DaemonOptions(server, transport=, timeout=,
    daemon_flags, resume                                      job_id=, flags=, resume=)

A call gives a value one way: a flat keyword of a group together with that
group's options object is a TypeError naming both. Torch-free (dmuon
imports it without torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


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
    timeout: seconds, connecting and waiting for any one update. job_id: the
    daemon-side job name (None: a random one; the ranks agree on rank 0's).
    flags: extra dmuond flags for the private daemon of server="auto".
    resume: what the job's momentum on dmuond must be when this DMuon opens
    it (docs/protocol.md "Resume"). "fresh" (or False, the default): start
    at step 1; a job_id whose job has completed a step (in the daemon's
    memory, or in its --state-dir snapshot) is an error naming its step.
    True (or "continue"): continue that job's momentum; an error if it has
    none. "replace": discard its momentum and start at step 1. "auto": the
    protocol 1.0 behaviour, continue if there is momentum, else start. All
    but "auto" need dmuond 1.1 (protocol minor 1) or newer.
    """

    server: str | Sequence[str] = "auto"
    _: dataclasses.KW_ONLY
    transport: str = "auto"
    timeout: float = 60.0
    job_id: str | None = None
    flags: Sequence[str] = ()
    resume: bool | str = "fresh"


# Each group's flat keywords, as {flat keyword: field}.
ADAMW_KEYWORDS = {"adamw_lr": "lr", "adamw_betas": "betas", "adamw_eps": "eps",
                  "adamw_wd": "weight_decay"}
DAEMON_KEYWORDS = {"server": "server", "transport": "transport", "timeout": "timeout",
                   "job_id": "job_id", "daemon_flags": "flags", "resume": "resume"}

# DaemonOptions.resume: each accepted value -> Client.open_session's resume.
RESUME_MODES = {False: "fresh", "fresh": "fresh", True: "continue",
                "continue": "continue", "replace": "replace", "auto": "auto"}


def resume_mode(value: Any) -> str:
    """Client.open_session's resume for DMuon's resume= (DaemonOptions.resume);
    a ValueError naming the accepted values for anything else."""
    if isinstance(value, (bool, str)) and value in RESUME_MODES:
        return RESUME_MODES[value]
    raise ValueError(
        f"DMuon: resume={value!r} is not one of \"fresh\" (or False, the default: "
        "start the job at step 1), True (or \"continue\": continue its momentum), "
        "\"replace\" (discard its momentum) or \"auto\" (continue if any)")


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

"""DMuon as torchtitan's optimizer: DMuonOptimizersContainer (torchtitan 0.3.0).

torchtitan has no optimizer registry; its extension point is a subclass of
OptimizersContainer (torchtitan.components.optimizer) with its own nested
Config, set as the Trainer config's `optimizer`:

    from dmuon.integrations.torchtitan import DMuonOptimizersContainer
    config.optimizer = DMuonOptimizersContainer.Config(
        lr=0.02, adamw_lr=3e-3, server="dmuond:50051")

The container builds one DMuon per model part, over the part's trainable
parameters named by their canonical FQNs (torchtitan's canonical_fqn, as
its own container names them). DMuon routes them by its own rules
(client/python/README.md, "Routing"): nn.Linear weights (torchtitan's Linear
is one; the fused wqkv is orthogonalized whole, as torch.optim.Muon does)
to Muon on dmuond, embeddings, norms, biases and other 1-D parameters to
its local AdamW; `adamw_patterns` (regular expressions searched in each
FQN, default the output head) send matrices to AdamW too.

Checkpointing is torchtitan's CheckpointManager calling OptimizersContainer's
state_dict / load_state_dict unchanged: torchtitan flattens each optimizer's
torch-layout state dict by FQN ("state.<fqn>.momentum_buffer", ...), which
is DMuon.state_dict()'s layout (dmuon/_dcp.py): each Muon parameter's
momentum (a DTensor laid out as the parameter under FSDP2/TP, so DCP
reshards it) and step, AdamW's state, every group.

torchtitan is optional: importing dmuon never imports it; importing this
module without it raises an ImportError saying what to install.
"""

from __future__ import annotations

import dataclasses
import re

from .. import _native

_native.require_torch("dmuon.integrations.torchtitan")
try:
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer import OptimizersContainer
except ModuleNotFoundError as e:
    if e.name is None or e.name.split(".")[0] != "torchtitan":
        raise
    raise ModuleNotFoundError(
        "dmuon.integrations.torchtitan needs torchtitan, which is not installed: "
        "pip install torchtitan==0.3.0 (or 'dmuon[torchtitan]')", name="torchtitan") from e

from torch import nn  # noqa: E402

from .. import AdamWOptions, DaemonOptions, OverlapOptions, RoutingOptions  # noqa: E402
from ..optim import DMuon  # noqa: E402

__all__ = ["DMuonOptimizersContainer"]


class DMuonOptimizersContainer(OptimizersContainer[DMuon]):
    """torchtitan's OptimizersContainer with one DMuon per model part."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """DMuon's hyperparameters, by torch.optim.Muon's and AdamW's names
        and defaults (AdamW's prefixed adamw_), which parameters go to AdamW,
        and which dmuond (dmuon.DaemonOptions' fields; its `flags` here
        `daemon_flags`). The inherited param_groups must stay empty: DMuon
        routes by its own rules and adamw_patterns."""

        lr: float = 1e-3
        weight_decay: float = 0.1
        momentum: float = 0.95
        nesterov: bool = True
        ns_steps: int = 5
        eps: float = 1e-7
        adjust_lr_fn: str | None = None
        adamw_lr: float = 1e-3
        adamw_betas: tuple[float, float] = (0.9, 0.999)
        adamw_eps: float = 1e-8
        adamw_weight_decay: float = 0.01
        adamw_patterns: list[str] = dataclasses.field(
            default_factory=lambda: [r"^(lm_head|output)\."])
        """Regular expressions searched in each canonical FQN: matching
        parameters go to AdamW (default: the output head, torchtitan's
        llama3 "lm_head", older models' "output")."""
        server: str | list[str] = "auto"
        transport: str = "auto"
        timeout: float = 60.0
        connect_timeout: float = 10.0
        job_id: str | None = None
        daemon_flags: list[str] = dataclasses.field(default_factory=list)
        resume: bool | str = "fresh"
        overlap_backward: bool = True
        """Hand each gradient to dmuond during backward (False: at step();
        see client/python/README.md, "Training frameworks", for CUDA graphs)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.param_groups:
            raise ValueError(
                "DMuonOptimizersContainer.Config: param_groups is OptimizersContainer's "
                "routing; DMuon routes by its own rules, send matrices to AdamW with "
                "adamw_patterns")
        if len(model_parts) > 1 and config.job_id is not None:
            raise ValueError(
                f"DMuonOptimizersContainer.Config: job_id={config.job_id!r} with "
                f"{len(model_parts)} model parts (pipeline stages): each part is a "
                "DMuon of its own, so one job_id would be opened twice; leave "
                "job_id unset (each part gets its own job), and note that pipeline "
                "parallelism is not supported (client/python/README.md, "
                "'Training frameworks')")
        self.model_parts = model_parts
        self.optimizers = [self._build(config, part) for part in model_parts]
        self._validate_params([p for opt in self.optimizers
                               for g in opt.param_groups for p in g["params"]])
        self._post_init([p for part in model_parts for p in part.parameters()
                         if p.requires_grad])

    @staticmethod
    def _build(config: Config, part: nn.Module) -> DMuon:
        """One part's DMuon over its trainable parameters, named by FQN."""
        named = [(canonical_fqn(n), p) for n, p in part.named_parameters()
                 if p.requires_grad]
        adamw = [p for n, p in named
                 if any(re.search(pattern, n) for pattern in config.adamw_patterns)]
        return DMuon(
            named, lr=config.lr, weight_decay=config.weight_decay,
            momentum=config.momentum, nesterov=config.nesterov,
            ns_steps=config.ns_steps, eps=config.eps, adjust_lr_fn=config.adjust_lr_fn,
            adamw_options=AdamWOptions(lr=config.adamw_lr, betas=tuple(config.adamw_betas),
                                       eps=config.adamw_eps,
                                       weight_decay=config.adamw_weight_decay),
            daemon_options=_daemon_options(config),
            routing_options=RoutingOptions(model=part, adamw=adamw),
            overlap_options=OverlapOptions(backward=config.overlap_backward))


def _daemon_options(config: DMuonOptimizersContainer.Config) -> DaemonOptions:
    server = config.server if isinstance(config.server, str) else list(config.server)
    return DaemonOptions(server, transport=config.transport, timeout=config.timeout,
                         connect_timeout=config.connect_timeout, job_id=config.job_id,
                         flags=tuple(config.daemon_flags), resume=config.resume)

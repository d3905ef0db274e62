"""dmuon: Muon's orthogonalization as a service.

    dmuon.orthogonalize(x)              Newton-Schulz on a numpy array or CPU tensor
    dmuon.Client / dmuon.Session        the C++ client (talk to dmuond directly)
    dmuon.optim.DMuon                   a torch.optim.Optimizer (import dmuon.optim;
                                        dmuon.torch is its old, deprecated name)
    dmuon.AdamWOptions / DaemonOptions  DMuon's grouped options (adamw_options=,
    dmuon.RoutingOptions / OverlapOptions daemon_options=, routing_options=,
                                        overlap_options=)
    dmuon.LocalDaemon                   a private dmuond for this process

See client/python/README.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from . import _native

if TYPE_CHECKING:
    import numpy as np
    import torch

_ext = _native.load()

Client = _ext.Client
Session = _ext.Session
Error = _ext.Error
InvalidArgumentError = _ext.InvalidArgumentError
UnavailableError = _ext.UnavailableError
DeadlineExceededError = _ext.DeadlineExceededError
FailedPreconditionError = _ext.FailedPreconditionError
__version__ = _ext.__version__
plan_pool = _ext.plan_pool

from ._daemon import LocalDaemon, find_dmuond  # noqa: E402
from ._options import AdamWOptions, DaemonOptions, OverlapOptions, RoutingOptions  # noqa: E402

_CONVERT = ("torch_param_groups", "to_torch_state_dicts", "to_torch",
            "from_torch_state_dicts", "load_torch_state_dicts")


def __getattr__(name: str):
    # DMuon <-> torch.optim.Muon + AdamW state (dmuon/_convert.py); imports
    # torch, so only when asked for.
    if name in _CONVERT:
        from . import _convert

        return getattr(_convert, name)
    raise AttributeError(f"module 'dmuon' has no attribute {name!r}")


# numpy float32/float64 arrays or CPU torch tensors: the result has the type
# of the input.
ArrayT = TypeVar("ArrayT", "np.ndarray", "torch.Tensor")


def orthogonalize(
    array: ArrayT,
    steps: int = 5,
    coefficients: str | Sequence[float] | Sequence[Sequence[float]] | None = None,
    method: str = "auto",
    eps: float = 1e-7,
) -> ArrayT:
    """The approximate polar factor of `array` by Newton-Schulz (Muon's NS).

    array: a 2-D matrix or a 3-D batch of matrices, numpy float32/float64 or a
    CPU torch tensor of those dtypes (the result has the same type).
    coefficients: None or "classic" (3.4445, -4.7750, 2.0315), "polar_express",
    "you", one (a, b, c) triple for every step, or a list of per-step triples.
    method: "auto" (the cost model picks), "direct", or "gram".
    Raises ValueError (dmuon.InvalidArgumentError) for bad input or options.
    """
    if type(array).__module__.split(".")[0] == "torch":
        import torch

        if array.device.type != "cpu":
            raise ValueError(
                f"dmuon.orthogonalize: expected a CPU tensor, got one on {array.device}"
            )
        out = _ext.orthogonalize(
            array.detach().contiguous().numpy(), steps, coefficients, method, eps
        )
        return torch.from_numpy(out)
    return _ext.orthogonalize(array, steps, coefficients, method, eps)


__all__ = [
    "Client",
    "Session",
    "LocalDaemon",
    "AdamWOptions",
    "DaemonOptions",
    "RoutingOptions",
    "OverlapOptions",
    "find_dmuond",
    "orthogonalize",
    "Error",
    "InvalidArgumentError",
    "UnavailableError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    *_CONVERT,
]

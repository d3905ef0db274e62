"""DMuon's AdamW half: the torch.optim.AdamW that updates every parameter
that is not a Muon matrix (DMuon's AdamW groups, use_muon False), stepped
in DMuon's step() while dmuond computes the Muon half."""

from __future__ import annotations

from typing import Any

import torch


class AdamWHalf:
    """A torch.optim.AdamW over a DMuon's AdamW groups, made with the first
    of them (none: step() does nothing). It holds the DMuon's group dicts
    and its state, not copies: relink() after either is replaced or grows
    (add_param_group, load_state_dict)."""

    def __init__(self, param_groups: list[dict[str, Any]], state: Any) -> None:
        self.optimizer: torch.optim.AdamW | None = None
        self.relink(param_groups, state)

    def relink(self, param_groups: list[dict[str, Any]], state: Any) -> None:
        """Takes the AdamW groups of param_groups (each given AdamW's
        defaults for any key it lacks: a loaded state_dict may lack newer
        torch's keys) and the optimizer's state."""
        groups = [g for g in param_groups if not g["use_muon"]]
        if not groups:
            return
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(groups)
        for g in groups:
            for k, v in self.optimizer.defaults.items():
                g.setdefault(k, v)
        self.optimizer.param_groups = groups
        self.optimizer.state = state

    def step(self) -> None:
        """AdamW's step of every AdamW group."""
        if self.optimizer is not None:
            self.optimizer.step()

"""The command line's optimizer settings win over a checkpoint's on resume.

Loading a checkpoint restores the optimizer's param_groups as saved (lr, betas, eps, weight_decay,
kernels) and the scheduler's base learning rates, so `--optimizer.lr` on a resumed run would be
silently ignored. The settings of the freshly built optimizer (made from the config) are recorded
before the load and put back after it; the learning rate is then the config's peak times the
schedule's factor at the resumed step.
"""
from __future__ import annotations

from typing import Any

import torch

_NOT_SETTINGS = ("params", "param_names", "lr", "initial_lr")


class OptimizerSettings:
    """The hyperparameters of `optimizer`'s groups as the config built them (after the scheduler
    recorded each group's peak learning rate as its `initial_lr`)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.groups = [{key: value for key, value in group.items() if key not in ("params", "param_names")}
                       for group in optimizer.param_groups]

    def reapply(self, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR) -> list[str]:
        """Put the recorded settings back into the loaded optimizer and scheduler; returns what changed
        (`name old -> new`, once per distinct change)."""
        assert len(optimizer.param_groups) == len(self.groups) == len(scheduler.lr_lambdas)
        changed: list[str] = []
        for i, (group, wanted) in enumerate(zip(optimizer.param_groups, self.groups)):
            peak = wanted.get("initial_lr", wanted["lr"])
            _note(changed, "lr (peak)", group.get("initial_lr", scheduler.base_lrs[i]), peak)
            for key, value in wanted.items():
                if key not in _NOT_SETTINGS:
                    _note(changed, key, group.get(key), value)
                    group[key] = value
            group["initial_lr"] = peak
            scheduler.base_lrs[i] = peak
            group["lr"] = peak * scheduler.lr_lambdas[i](scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        return changed


def _note(changed: list[str], key: str, old: Any, new: Any) -> None:
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):  # betas come back as a list
        old, new = tuple(old), tuple(new)
    change = f"{key} {old} -> {new}"
    if old != new and change not in changed:  # once per distinct change (Muon's groups have two peaks)
        changed.append(change)

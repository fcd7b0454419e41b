"""Stateful adapters over torch.distributed.checkpoint.state_dict, for FSDP2/TP/DDP or plain models.

Put them in the state given to Checkpointer.save/load: a save calls their state_dict() (parameters
and optimizer states as DTensors where sharded, keyed by parameter name), a load fills that state
in place and hands it to their load_state_dict().
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)


class ModelState:
    """A model's parameters and buffers, via get_model_state_dict / set_model_state_dict."""

    def __init__(self, model: torch.nn.Module, *, options: StateDictOptions | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ModelState needs an nn.Module, got {type(model).__name__}")
        self.model, self.options = model, options

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=self.options)


class OptimizerState:
    """An optimizer's state keyed by parameter name, via get/set_optimizer_state_dict.

    Its state exists before the first step too (torch initializes it), so a fresh optimizer can be
    loaded into.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, options: StateDictOptions | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"OptimizerState needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.model, self.optimizer, self.options = model, optimizer, options

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self.options)

"""The run's checkpoint state (docs/conventions.md) saved and restored through torch-checkpointing.

State: {"model", "optimizer", "scheduler", "data", "rng", "step"}; model and optimizer entries come from
torch.distributed.checkpoint.state_dict, so they hold DTensors for sharded parameters and load into any
layout torch-checkpointing can reshard to.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch_checkpointing import Checkpointer


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class RunCheckpoints:
    """Saves every `interval` steps (asynchronously when asked), keeps the last `keep_last`, resumes."""

    def __init__(self, folder: Path, *, keep_last: int, async_save: bool):
        self.checkpointer = Checkpointer(str(folder), keep_last=keep_last or None)
        self.async_save = async_save
        self._pending = None

    def state(self, model: nn.Module, optimizer, scheduler, loader, step: int, device: torch.device) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer),
            "scheduler": scheduler.state_dict(),
            "data": loader.state_dict(),
            "rng": rng_state(device),
            "step": step,
        }

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.wait()  # one save in flight at a time: its staging buffers are reused
        handle = self.checkpointer.save(step, state)
        if self.async_save:
            self._pending = handle
        else:
            handle.wait()

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def latest_step(self) -> int | None:
        return self.checkpointer.latest_step()

    def restore(self, model: nn.Module, optimizer, scheduler, loader, device: torch.device) -> int:
        """Load the newest checkpoint into the run's objects; returns its step."""
        state = self.state(model, optimizer, scheduler, loader, 0, device)
        self.checkpointer.load(state)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["data"])
        set_rng_state(state["rng"], device)
        return int(state["step"])

    def close(self) -> None:
        self.wait()
        self.checkpointer.close()

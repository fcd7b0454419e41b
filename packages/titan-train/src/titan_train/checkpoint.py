"""The run's checkpoint state (docs/conventions.md) saved and restored through torch-checkpointing.

State: {"model", "optimizer", "scheduler", "data", "rng", "step"}. Model and optimizer go through
torch-checkpointing's adapters over torch.distributed.checkpoint.state_dict, so they hold DTensors for
sharded parameters and load into any layout; the scheduler, the data loader and the RNG are stateful
objects whose state_dict() is saved and whose load_state_dict() a load calls.

Failures are loud and early: an asynchronous save that failed (a full disk, a read-only folder) stops
the run at the trainer's next step (`RunCheckpoints.poll`), its unfinished folder removed and the
last committed step intact; a damaged checkpoint is not resumed from: torch-checkpointing falls back
to the newest intact step with a warning naming the damage and where the damaged step was moved.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from torch_checkpointing import Checkpointer, CommitError, ModelState, OptimizerState

ENTRIES = ("model", "optimizer", "scheduler", "data", "rng", "step")


def check_exclude(patterns: tuple[str, ...]) -> None:
    """checkpoint.exclude: each pattern must match one of the state's entries."""
    for pattern in patterns:
        if not fnmatch.filter(ENTRIES, pattern):
            raise ValueError(f"checkpoint.exclude: {pattern!r} matches no checkpoint entry; entries: "
                             f"{', '.join(ENTRIES)}")


class RNGState:
    """torch's CPU (and current CUDA device's) generator state.

    Saved per rank (torch-checkpointing's `per_rank`), so each rank resumes its own generator even where
    ranks draw differently. The trainer seeds every rank alike, so the states usually agree, and then a
    run also resumes on another number of ranks (torch-checkpointing loads a per-rank entry there only
    when every saved rank stored the same bytes)."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)


class RunCheckpoints:
    """Saves every `interval` steps (asynchronously when asked), keeps the last `keep_last`, resumes."""

    def __init__(self, folder: Path, *, keep_last: int, async_save: bool,
                 adapt: Callable[[dict[str, Any]], dict[str, Any]] | None = None, exclude: tuple[str, ...] = (),
                 trainable_only: bool = False):
        """exclude: entries a restore leaves alone (checkpoint.exclude). trainable_only: the model entry holds
        the trainable parameters only (LoRA: the adapters; the frozen base is rebuilt from the initial weights)."""
        self.folder = folder
        self.checkpointer = Checkpointer(str(folder), keep_last=keep_last or None, per_rank=("rng",))
        self.async_save = async_save
        self.adapt = adapt  # rewrites the state of every save and load (pipeline parallelism: each rank's stages)
        self.exclude = exclude
        self.model_options = self.model_options_for(trainable_only=trainable_only)

    @staticmethod
    def model_options_for(*, trainable_only: bool) -> StateDictOptions | None:
        """How the model entry is read and written: all of it, or its trainable parameters only (LoRA)."""
        # strict=False: a load fills the trainable parameters and leaves the frozen ones (which the state
        # lacks) alone; torch-checkpointing still refuses a checkpoint that lacks one of the state's tensors.
        return StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None

    def state(self, model: nn.Module, optimizer, scheduler, loader, step: int, device: torch.device) -> dict[str, Any]:
        state = {"model": ModelState(model, options=self.model_options), "optimizer": OptimizerState(model, optimizer),
                 "scheduler": scheduler, "data": loader, "rng": RNGState(device), "step": step}
        return self.adapt(state) if self.adapt is not None else state

    def save(self, step: int, state: dict[str, Any]) -> None:
        # save() returns once the state is staged (training may go on); the write finishes behind it.
        self._stop_on_failure(lambda: self.checkpointer.save(step, state, blocking=not self.async_save))

    def poll(self) -> None:
        """Called once per step: raises (stopping the run) if an asynchronous save has failed since."""
        self._stop_on_failure(self.checkpointer.raise_if_failed)

    def _stop_on_failure(self, call: Callable[[], Any]) -> None:
        try:
            call()
        except (CommitError, OSError) as e:
            latest = self.checkpointer.latest_step()
            kept = f"step {latest} is the newest committed checkpoint" if latest is not None else "no step is committed"
            raise CommitError(f"checkpointing to {self.folder} failed, so the run stops: {e}; {kept} "
                              "(its unfinished folder was removed)") from e

    def latest_step(self) -> int | None:
        return self.checkpointer.latest_step()

    def steps(self) -> list[int]:
        return self.checkpointer.steps()

    def restore(self, model: nn.Module, optimizer, scheduler, loader, device: torch.device, *,
                step: int | None = None) -> int:
        """Load the newest intact committed checkpoint (or `step`) into the run's objects, but for the excluded
        entries; returns the step the run continues after (0 when `step` itself is excluded).

        A damaged newer step (checksums, missing or cut files) is moved aside to damaged-step-N with a
        RuntimeWarning naming the damage; every step damaged raises torch_checkpointing.ChecksumError."""
        state = self.state(model, optimizer, scheduler, loader, 0, device)
        for name in [name for name in state if any(fnmatch.fnmatchcase(name, p) for p in self.exclude)]:
            del state[name]
        self.checkpointer.load(state, step)
        return int(state.get("step", 0))

    def close(self) -> None:
        """Wait for the saves in flight to commit, then release the checkpointer."""
        try:
            self.checkpointer.wait()
        finally:
            self.checkpointer.close()

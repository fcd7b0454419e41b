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

from torch_checkpointing import Checkpointer, CommitError, ModelState, OptimizerState, SaveHandle

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
    """Saves every `interval` steps (asynchronously when asked), keeps the last `keep_last`, resumes.

    An asynchronous save returns once the device-to-host copies are queued; the trainer calls
    before_optimizer_step() right before every optimizer step, which orders that step after the copies
    (on the GPU, without blocking the host), so the next step's forward and backward run while they do.
    reserve(), once after the first step, allocates the pinned staging memory in the background, so
    a first save that comes after the allocation ended (the first steps overlap it) costs what later
    ones do; one that comes sooner (checkpoint.interval 1) waits for the rest of it and is as correct.
    Not before the first step: the optimizer has no moments yet, and asking torch.distributed.checkpoint
    for its state then runs a zero-lr optimizer step that would advance AdamW's step count.
    """

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
        self._copying: SaveHandle | None = None  # a save whose copies the next optimizer step must follow
        self._reserved = False

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

    def reserve(self, state: dict[str, Any]) -> None:
        """Lay out the state and allocate its staging memory in the background (the first call only; every
        rank calls it at the same step, after the optimizer has made its moments)."""
        if not self._reserved:
            self.checkpointer.reserve(state)
            self._reserved = True

    def save(self, step: int, state: dict[str, Any]) -> None:
        if not self.async_save:
            self._stop_on_failure(lambda: self.checkpointer.save(step, state, blocking=True))
            return

        # manual_release: the trainer's stream is not made to wait for the copies here (that would hold
        # the next forward pass back), but in before_optimizer_step(), before anything changes the state.
        def start() -> None:
            self._copying = self.checkpointer.save(step, state, manual_release=True)

        self._stop_on_failure(start)

    def before_optimizer_step(self) -> None:
        """Order the coming optimizer step after the last save's copies (a no-op when none is pending)."""
        if self._copying is not None:
            self._copying.order_current_stream()
            self._copying = None

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
        self.before_optimizer_step()  # whatever the caller does with the state next comes after the copies
        try:
            self.checkpointer.wait()
        finally:
            self.checkpointer.close()

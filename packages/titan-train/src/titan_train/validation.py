"""Validation: the loss over the same first `steps` batches of a held-out source, every `interval` steps
and after the last one, through the training forward of the run's layout (pipeline: the last stage's loss)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .data import IGNORE_INDEX, Batch


class Validator:
    def __init__(self, loader: Any, *, interval: int, steps: int, batch_size: int):
        """loader: a PackedLoader over the held-out source, at its start (each evaluation rewinds it there)."""
        self.loader, self.start = loader, loader.state_dict()
        self.interval, self.steps, self.batch_size = interval, steps, batch_size

    def due(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.interval > 0 and step % self.interval == 0)

    @torch.no_grad()
    def evaluate(self, summed_loss: Callable[[Batch], torch.Tensor]) -> dict[str, float]:
        """{eval_loss, eval_perplexity}: the mean loss per scored token over the batches. `summed_loss`: a
        global batch -> its summed loss over every rank's tokens (the same on all ranks)."""
        self.loader.load_state_dict(self.start)
        loader = self.loader
        total, scored = 0.0, 0
        for _ in range(self.steps):
            batch = loader.next_batch(self.batch_size)
            total += float(summed_loss(batch))
            scored += int((batch.labels != IGNORE_INDEX).sum())
        loss = total / max(scored, 1)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}

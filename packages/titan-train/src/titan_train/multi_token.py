"""Multi-token prediction (DeepSeek-V3, depth 1): the MTP module's inputs and targets for a batch, and
the weight its summed loss gets in the objective.

Position i of a sequence feeds the MTP module the main model's final hidden state at i and the
embedding of token i + 1 (`tokens` rolled left by one, as titan-models' forward_with_mtp does: the
last position pairs with a filler, the row's first token) and asks for token i + 2 (`labels` rolled left
by one). A target is ignored where token i + 2 lies in another document than token i, or past the
sequence (the last position). Each row is computed from its own tokens, so the targets of the global
batch can be sliced into data-parallel rows and microbatches like the main labels; being shifted on whole
sequences, they are then cut into context-parallel chunks like the main labels too (the tokens after a
chunk's last position live on another cp rank).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .data import IGNORE_INDEX


@dataclass(frozen=True)
class MTPBatch:
    tokens: torch.Tensor
    """[rows, s]: token i + 1 at position i."""
    labels: torch.Tensor
    """[rows, s]: token i + 2 at position i, IGNORE_INDEX where it has none."""

    def rows(self, start: int, stop: int) -> MTPBatch:
        return MTPBatch(self.tokens[start:stop], self.labels[start:stop])

    def to(self, device: torch.device) -> MTPBatch:
        return MTPBatch(self.tokens.to(device), self.labels.to(device))


def mtp_batch(tokens: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None) -> MTPBatch:
    """The MTP inputs and targets of a batch (tokens, labels, document_ids [rows, s]; see the module docstring)."""
    mtp_labels = labels.roll(-1, dims=1)
    mtp_labels[:, -1] = IGNORE_INDEX
    if document_ids is not None:  # token i + 1 opens another document: token i + 2 is not token i's to predict
        mtp_labels = torch.where(document_ids.roll(-1, dims=1) == document_ids, mtp_labels, IGNORE_INDEX)
    return MTPBatch(tokens.roll(-1, dims=1), mtp_labels)


def mtp_weight(loss_weight: float, *, scored: int, mtp_scored: int) -> float:
    """The factor of the summed MTP loss in the summed objective, so that the objective is
    main mean + loss_weight * MTP mean, each over its own scored tokens of the global batch (the trainer
    then scales the sum by 1 / scored)."""
    return loss_weight * scored / max(mtp_scored, 1)


def mtp_objective(sums: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor:
    """The summed objective of a microbatch from the loss module's (main, MTP) sums [2]: main + weight * MTP,
    weight being mtp_weight's. Eager autograd and graph mode's captured step both differentiate this, so the
    two run the same ops (weight a Python float there, a float32 0-dim tensor here: the same product)."""
    return sums[0] + weight * sums[1]

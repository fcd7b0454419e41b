"""Uniform random tokens: a data source for throughput benchmarks and smoke tests (`data.source=random`).

Row i of the stream is drawn from a generator seeded by (seed, i), so a batch depends only on its
position: the loader's state is one integer and any other program can reproduce the same batches.
"""
from __future__ import annotations

import torch

from .loader import Batch


def random_rows(vocab_size: int, seq_len: int, *, seed: int, first_row: int, rows: int) -> torch.Tensor:
    """Rows `first_row ..` of the stream: [rows, seq_len + 1] int64 token ids in [0, vocab_size)."""
    out = torch.empty(rows, seq_len + 1, dtype=torch.int64)
    generator = torch.Generator()
    for i in range(rows):
        generator.manual_seed(seed * 1_000_003 + first_row + i)
        out[i] = torch.randint(vocab_size, (seq_len + 1,), generator=generator)
    return out


class RandomTokenLoader:
    """`next_batch(rows)` -> Batch of uniform random tokens (labels are the next tokens; one document)."""

    def __init__(self, vocab_size: int, *, seq_len: int, seed: int = 0):
        if vocab_size < 2 or seq_len < 1:
            raise ValueError(f"random tokens need vocab_size >= 2 and seq_len >= 1, got {vocab_size}, {seq_len}")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.row = 0

    def state_dict(self) -> dict[str, int]:
        return {"row": self.row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.row = int(state["row"])

    def next_batch(self, rows: int) -> Batch:
        window = random_rows(self.vocab_size, self.seq_len, seed=self.seed, first_row=self.row, rows=rows)
        self.row += rows
        return Batch(window[:, :-1].contiguous(), window[:, 1:].contiguous(), None)

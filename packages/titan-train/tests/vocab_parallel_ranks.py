"""Ranks of test_loss.py's vocabulary-parallel check (a module of its own: spawned processes import it)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from titan_train_ranks import join_gloo

from titan_train.data import IGNORE_INDEX
from titan_train.loss import fused_linear_cross_entropy


def rank_main(rank: int, world: int, init_method: str, queue) -> None:
    join_gloo(rank, world, init_method)
    try:
        h, w, y = vocab_parallel_inputs()
        rows = w.shape[0] // world
        h = h.clone().requires_grad_()
        w_mine = w[rank * rows:(rank + 1) * rows].clone().requires_grad_()
        loss = fused_linear_cross_entropy(h, w_mine, y, chunk=37, vocab_group=dist.group.WORLD)
        loss.backward()
        grad_h = h.grad.clone()
        dist.all_reduce(grad_h)  # each rank's partial gradient of the hidden states
        # as lists: shared-memory tensors would not outlive this process's os._exit
        queue.put((rank, loss.item(), grad_h.tolist(), w_mine.grad.tolist()))
    finally:
        dist.destroy_process_group()
    os._exit(0)


def vocab_parallel_inputs():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 96, 16, generator=g, dtype=torch.float64)
    w = torch.randn(40, 16, generator=g, dtype=torch.float64)
    y = torch.randint(0, 40, (2, 96), generator=g)
    y[0, :7] = IGNORE_INDEX
    return h, w, y


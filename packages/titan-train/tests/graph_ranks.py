"""Ranks of test_graph_mode.py's FSDP runs (a module of its own: spawned processes import it)."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def rank_main(rank: int, world: int, init_method: str, configs: list) -> None:
    """Train each of `configs` in turn (one process group: the ranks start once); rank 0 saves each run's
    final full weights into its job folder."""
    from titan_train_ranks import join_gloo

    from titan_train.trainer import Trainer

    torch.set_num_threads(1)
    join_gloo(rank, world, init_method)
    try:
        for config in configs:
            trainer = Trainer(config, torch.device("cpu"))
            trainer.run()
            weights = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach()
                       for n, p in trainer.model.named_parameters()}
            if rank == 0:
                torch.save(weights, Path(config.job.folder) / "final_weights.pt")
            del trainer
    finally:
        dist.destroy_process_group()
    os._exit(0)

"""The device and the process group of one rank (torchrun's environment), shared by the trainer and the
RL job."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Literal

import torch
import torch.distributed as dist


def select_device(kind: Literal["auto", "cpu", "cuda"]) -> torch.device:
    """auto: cuda when available, else cpu; cuda is this rank's GPU (LOCAL_RANK)."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("job.device=cuda but torch sees no CUDA device")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """Join the process group torchrun describes (gloo on CPU, nccl on GPU) unless one exists already."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    created = False
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        created = True
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()

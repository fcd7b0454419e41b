"""The DeviceMesh of a run, from the parallelism degrees."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ParallelismConfig

# Mesh dimensions outermost first: replicas span the slowest links, tensor parallel the fastest.
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True, kw_only=True)
class Degrees:
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1
    """Expert parallel degree: a factor of dp_shard (expert_parallel.py splits that dimension)."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def resolve_degrees(config: ParallelismConfig, world_size: int) -> Degrees:
    """Check the degrees against the world size and fill in dp_shard=-1 ("the rest")."""
    for name in ("pp", "cp"):
        value = getattr(config, name)
        if value < 1:
            raise ValueError(f"parallelism.{name} must be >= 1, got {value}")
        if value > 1:
            raise ValueError(f"parallelism.{name}={value}: {name} > 1 arrives in issue 7 "
                             "(this trainer runs dp_replicate, dp_shard and tp)")
    for name in ("dp_replicate", "tp", "ep"):
        if getattr(config, name) < 1:
            raise ValueError(f"parallelism.{name} must be >= 1, got {getattr(config, name)}")
    others = config.dp_replicate * config.tp
    dp_shard = config.dp_shard
    if dp_shard == -1:
        if world_size % others:
            raise ValueError(f"world size {world_size} is not divisible by dp_replicate * tp = {others}")
        dp_shard = world_size // others
    elif dp_shard < 1:
        raise ValueError(f"parallelism.dp_shard must be >= 1 or -1 (the rest), got {dp_shard}")
    if others * dp_shard != world_size:
        raise ValueError(f"parallelism degrees dp_replicate={config.dp_replicate} x dp_shard={dp_shard} x "
                         f"tp={config.tp} = {others * dp_shard}, but the world size is {world_size}")
    if dp_shard % config.ep:
        raise ValueError(f"parallelism.ep={config.ep} must divide dp_shard={dp_shard}: expert parallelism borrows "
                         "its ranks from the data-parallel shard dimension")
    return Degrees(dp_replicate=config.dp_replicate, dp_shard=dp_shard, tp=config.tp, ep=config.ep)


def build_mesh(degrees: Degrees, device: torch.device) -> DeviceMesh | None:
    """A 3-D mesh (dp_replicate, dp_shard, tp) over the process group; None for a single process."""
    if not dist.is_initialized():
        return None
    return init_device_mesh(device.type, (degrees.dp_replicate, degrees.dp_shard, degrees.tp), mesh_dim_names=MESH_DIMS)


def dp_rank(mesh: DeviceMesh | None, degrees: Degrees) -> int:
    """This rank's position among the data-parallel ranks (which rows of the global batch it takes)."""
    if mesh is None:
        return 0
    return mesh.get_local_rank("dp_replicate") * degrees.dp_shard + mesh.get_local_rank("dp_shard")

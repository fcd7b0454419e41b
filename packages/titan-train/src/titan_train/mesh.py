"""The DeviceMesh of a run, from the parallelism degrees."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ParallelismConfig

# Mesh dimensions outermost first: pipeline stages and replicas span the slowest links (little traffic),
# tensor parallel the fastest; context parallel's ring exchange sits next to it.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True, kw_only=True)
class Degrees:
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1
    """Expert parallel degree: a factor of dp_shard (expert_parallel.py splits that dimension)."""
    pp: int = 1
    """Pipeline stages' ranks (pipeline.py)."""
    cp: int = 1
    """Context parallel ranks: each holds 1/cp of every sequence (context_parallel.py); FSDP shards over
    dp_shard x cp."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def resolve_degrees(config: ParallelismConfig, world_size: int) -> Degrees:
    """Check the degrees against the world size and fill in dp_shard=-1 ("the rest")."""
    for name in ("dp_replicate", "tp", "ep", "pp", "cp"):
        if getattr(config, name) < 1:
            raise ValueError(f"parallelism.{name} must be >= 1, got {getattr(config, name)}")
    others = config.dp_replicate * config.tp * config.pp * config.cp
    dp_shard = config.dp_shard
    if dp_shard == -1:
        if world_size % others:
            raise ValueError(f"world size {world_size} is not divisible by dp_replicate * tp * pp * cp = {others}")
        dp_shard = world_size // others
    elif dp_shard < 1:
        raise ValueError(f"parallelism.dp_shard must be >= 1 or -1 (the rest), got {dp_shard}")
    if others * dp_shard != world_size:
        raise ValueError(f"parallelism degrees pp={config.pp} x dp_replicate={config.dp_replicate} x "
                         f"dp_shard={dp_shard} x cp={config.cp} x tp={config.tp} = {others * dp_shard}, but the "
                         f"world size is {world_size}")
    if dp_shard % config.ep:
        raise ValueError(f"parallelism.ep={config.ep} must divide dp_shard={dp_shard}: expert parallelism borrows "
                         "its ranks from the data-parallel shard dimension")
    return Degrees(dp_replicate=config.dp_replicate, dp_shard=dp_shard, tp=config.tp, ep=config.ep, pp=config.pp,
                   cp=config.cp)


def build_mesh(degrees: Degrees, device: torch.device) -> DeviceMesh | None:
    """A 5-D mesh (pp, dp_replicate, dp_shard, cp, tp) over the process group; None for a single process."""
    if not dist.is_initialized():
        return None
    shape = (degrees.pp, degrees.dp_replicate, degrees.dp_shard, degrees.cp, degrees.tp)
    return init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)


def fsdp_mesh(mesh: DeviceMesh, degrees: Degrees) -> DeviceMesh:
    """The mesh FSDP shards (and reduces gradients) over: dp_shard x cp flattened, as context-parallel ranks
    hold other tokens of the same sequences; 2-D with dp_replicate for HSDP."""
    shard = mesh["dp_shard"]
    if degrees.cp > 1:
        shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if degrees.dp_replicate > 1:
        return mesh["dp_replicate", shard.mesh_dim_names[0]]
    return shard


def dp_rank(mesh: DeviceMesh | None, degrees: Degrees) -> int:
    """This rank's position among the data-parallel ranks (which rows of the global batch it takes)."""
    if mesh is None:
        return 0
    return mesh.get_local_rank("dp_replicate") * degrees.dp_shard + mesh.get_local_rank("dp_shard")

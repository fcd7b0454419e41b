"""How the trainer ranks of an RL job split the policy and the update's batch.

The trainer ranks are the whole world (colocated generation) or its first ranks (generator.ranks > 0).
Over them, in this order of rank index (rank r of the trainers):

    tp  training.tensor_parallel consecutive ranks split every layer (titan-train's TP plan, sequence
        parallel); they hold the same samples
    cp  training.context_parallel consecutive ranks split every sequence (ring attention); they hold the
        same samples
    dp  the rest: data parallel, each its own slice of the samples; FSDP shards the parameters over them
        (over dp x cp when cp > 1, as titan-train's trainer does, since cp ranks hold whole layers)

so the update's data-parallel coordinates are r // (cp x tp) of trainers // (cp x tp). The mesh FSDP and TP
run on is 1-D ("dp_shard", every trainer rank) without TP and 2-D ("dp_shard", "tp") with it, built from
groups of the trainer ranks only, so the generator ranks hold none of it; the weight sync gathers each
DTensor over it (titan_rl.full_tensors) into the generators' whole, TP1 layout. `new_group` needs every
rank of the world to create every group in the same order, so every rank, generator ranks included,
runs `make_trainer_layout`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(kw_only=True)
class TrainerLayout:
    ranks: list[int]
    """The trainer ranks (global ranks, the world's first ones)."""
    group: dist.ProcessGroup | None
    """All trainer ranks (None: the whole world, colocated generation)."""
    mesh: DeviceMesh | None
    """What FSDP (dim "dp_shard") and TP (dim "tp") run on; None on a single trainer rank."""
    cp_group: dist.ProcessGroup | None
    """This rank's context-parallel group (None when training.context_parallel is 1)."""
    tp_group: dist.ProcessGroup | None
    """This rank's tensor-parallel group (None when training.tensor_parallel is 1)."""
    cp: int = 1
    tp: int = 1

    @property
    def replicas(self) -> int:
        """Consecutive ranks holding the same samples (their losses are equal copies)."""
        return self.cp * self.tp

    @property
    def dp_world(self) -> int:
        return len(self.ranks) // self.replicas

    @property
    def dp_rank(self) -> int:
        return self.ranks.index(dist.get_rank()) // self.replicas if dist.is_initialized() else 0


def single_process_layout() -> TrainerLayout:
    return TrainerLayout(ranks=[0], group=None, mesh=None, cp_group=None, tp_group=None)


def _consecutive_groups(ranks: list[int], size: int) -> dist.ProcessGroup | None:
    """This rank's group among `ranks` cut into runs of `size` (every rank of the world creates them all)."""
    mine = None
    for first in range(0, len(ranks), size):
        members = ranks[first:first + size]
        group = dist.new_group(members)
        if dist.get_rank() in members:
            mine = group
    return mine


def _strided_groups(ranks: list[int], stride: int) -> dist.ProcessGroup | None:
    """This rank's group of `ranks[j::stride]` (the data-parallel peers of a TP layout)."""
    mine = None
    for j in range(stride):
        members = ranks[j::stride]
        group = dist.new_group(members)
        if dist.get_rank() in members:
            mine = group
    return mine


def make_trainer_layout(ranks: list[int], *, group: dist.ProcessGroup | None, cp: int, tp: int,
                        device: torch.device) -> TrainerLayout | None:
    """The layout of the trainer `ranks` (None on a generator rank). A collective of the whole world.

    build.validate checked that cp x tp divides the trainer ranks and that cp and tp are not both > 1."""
    if not dist.is_initialized():
        assert cp == tp == 1, "build.validate: one process has no context- or tensor-parallel peers"
        return single_process_layout()
    assert len(ranks) % (cp * tp) == 0 and min(cp, tp) == 1
    cp_group = _consecutive_groups(ranks, cp) if cp > 1 else None
    tp_group = _consecutive_groups(ranks, tp) if tp > 1 else None
    dp_group = _strided_groups(ranks, tp) if tp > 1 else None
    if dist.get_rank() not in ranks:
        return None
    mesh = None
    if tp > 1:
        grid = torch.tensor(ranks).view(len(ranks) // tp, tp)
        mesh = DeviceMesh.from_group([dp_group, tp_group], device.type, mesh=grid, mesh_dim_names=("dp_shard", "tp"))
    elif len(ranks) > 1:
        mesh = (init_device_mesh(device.type, (len(ranks),), mesh_dim_names=("dp_shard",)) if group is None
                else DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp_shard",)))
    return TrainerLayout(ranks=ranks, group=group, mesh=mesh, cp_group=cp_group, tp_group=tp_group, cp=cp, tp=tp)

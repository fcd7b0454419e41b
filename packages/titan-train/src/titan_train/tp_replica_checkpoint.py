"""Checkpoint entries of tensors that every tensor-parallel rank holds whole, made to fit torch-checkpointing.

Under expert parallelism x TP the MoE layers are not TP-split: each tp rank keeps the same expert shards,
as DTensors on a mesh of its own tp slice ((dp_shard_mod_ep, ep), see expert_parallel.py). torch-checkpointing
reads a DTensor's mesh and placements to decide who writes which piece, so each tp slice would claim the
whole tensor and the save is refused (the ranks' pieces overlap). `TPReplicaEntries` wraps a ModelState /
OptimizerState so that such a DTensor is presented on the wider mesh (tp, *its mesh) with Replicate over
tp: the same local tensor (a view; a load fills the live shard in place), now saying that the tp ranks hold
copies, so exactly one of them writes each piece (torch-checkpointing spreads the choice by name) and a
load fills every copy. A DTensor whose mesh already spans tp (dense layers under FSDP x TP), and every
plain tensor (written once over the world anyway: the router gates, the expert biases), pass unchanged.
The checkpoint then reads like a single-process one: same names, full shapes, each piece stored once.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from .pipeline_checkpoint import _copy_containers, _set, _tensor_leaves


class TPReplicaEntries:
    """A Stateful (ModelState or OptimizerState) whose DTensors living inside one tp slice are presented as
    replicated over tp; see the module docstring. run_mesh: the run's mesh, with a "tp" dimension."""

    def __init__(self, inner: Any, *, run_mesh: DeviceMesh):
        self.inner = inner
        tp_dim = run_mesh.mesh_dim_names.index("tp")
        # tp_peers[t, j]: the rank with tp coordinate t in the j-th group of tp ranks (same other coordinates)
        self.tp_peers = run_mesh.mesh.movedim(tp_dim, 0).reshape(run_mesh.mesh.shape[tp_dim], -1)
        tp, groups = self.tp_peers.shape
        ranks = self.tp_peers.reshape(-1)
        self.group_of = torch.empty(int(ranks.max()) + 1, dtype=torch.long)
        self.group_of[ranks] = torch.arange(groups).repeat(tp)
        self.tp_coordinate_of = torch.empty_like(self.group_of)
        self.tp_coordinate_of[ranks] = torch.arange(tp).repeat_interleave(groups)
        self._wrapped: dict[tuple, torch.Tensor] = {}

    def state_dict(self) -> dict[str, Any]:
        # Fresh containers: the optimizer's state dict shares its per-parameter dicts with the live optimizer.
        state = _copy_containers(self.inner.state_dict())
        self._wrapped = {}
        for path, t in _tensor_leaves(state):
            if isinstance(t, DTensor) and self._inside_one_tp_slice(t.device_mesh):
                self._wrapped[path] = t
                _set(state, path, self._replicated_over_tp(t))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The checkpoint filled the wrapped DTensors' local tensors in place: hand the originals back.
        for path, original in self._wrapped.items():
            _set(state, path, original)
        self.inner.load_state_dict(state)

    def _inside_one_tp_slice(self, mesh: DeviceMesh) -> bool:
        ranks = mesh.mesh.reshape(-1)
        return mesh.get_coordinate() is not None and bool((self.tp_coordinate_of[ranks] ==
                                                           self.tp_coordinate_of[ranks[0]]).all())

    def _replicated_over_tp(self, t: DTensor) -> DTensor:
        ranks = t.device_mesh.mesh
        wide = self.tp_peers[:, self.group_of[ranks]]  # [tp, *mesh shape]: each rank's tp peers before it
        # Built without process groups: checkpointing only asks a mesh for its shape and this rank's coordinate.
        mesh = DeviceMesh(t.device_mesh.device_type, wide, _init_backend=False)
        return DTensor.from_local(t.to_local().detach(), mesh, [Replicate(), *t.placements], run_check=False,
                                  shape=t.shape, stride=t.stride())

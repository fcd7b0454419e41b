"""The RL policy on the ranks: built on meta, switched to batch-invariant modules when asked, split by
context or tensor parallelism and sharded with FSDP (torch's fully_shard) over the trainer ranks
(trainer_layout.py), then given full weights; plus the unsharded copies that a
generator and a KL reference need.

The model itself is the FSDP root (unlike pretraining, whose root is the fused-loss wrapper): RL needs
per-token logprobs, which come out of the model's own forward (`titan_rl.token_logprobs`), so every
parameter is used inside the root's forward. Batch-invariant mode swaps modules (same parameter names)
and therefore happens before sharding, which tracks parameters by their owning module.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import titan_rl

from ..context_parallel import apply_context_parallel
from ..model_setup import build_on_meta
from ..parallelize import apply_tensor_parallel
from .trainer_layout import TrainerLayout


def initial_weights(model_cfg, *, seed: int) -> dict[str, torch.Tensor]:
    """The initial weights of `model_cfg` on rank 0 ({} elsewhere): what RL starts from without pretraining."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    model = build_on_meta(model_cfg).to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.state_dict()


def build_policy(model_cfg, full_state: dict[str, torch.Tensor], *, device: torch.device,
                 batch_invariant: bool, layout: TrainerLayout | None = None) -> nn.Module:
    """The trainable policy, laid out over the trainer ranks of `layout` (None: FSDP over all ranks when there
    are several) and holding `full_state`: rank 0's full weights, broadcast to the others' shards when the
    trainers are the whole world; otherwise every trainer rank holds them (share_full_state). With a
    context-parallel group its attention is the ring over that group; with a "tp" mesh dimension its layers
    are split by titan-train's TP plan (parallelize.apply_tensor_parallel) before FSDP shards what is left
    over "dp_shard"."""
    model = build_on_meta(model_cfg)
    if batch_invariant:
        titan_rl.batch_invariant(model)
    if layout is not None and layout.cp_group is not None:
        apply_context_parallel(model, layout.cp_group)
    mesh = layout.mesh if layout is not None else _world_mesh(device)
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
        apply_tensor_parallel(model, mesh["tp"])
        mesh = mesh["dp_shard"]
    if mesh is not None and mesh.size() > 1:
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    model.init_buffers()  # buffers (RoPE frequencies) are computed, not loaded: to_empty left them uninitialised
    # torch's broadcast_from_rank0 runs on the default group only: with generator ranks each trainer holds them
    broadcast = dist.is_initialized() and dist.get_world_size() > 1 and (layout is None or layout.group is None)
    set_model_state_dict(model, full_state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast))
    return model


def _world_mesh(device: torch.device) -> DeviceMesh | None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    return init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",)) if world > 1 else None


def share_full_state(model_cfg, full_state: dict[str, torch.Tensor], *, group: dist.ProcessGroup, src: int,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """Rank `src`'s full weights on every rank of `group` (broadcast tensor by tensor, on `device`)."""
    shapes = build_on_meta(model_cfg).state_dict()
    out = {}
    for name, meta in shapes.items():
        tensor = (full_state[name].to(device) if dist.get_rank() == src
                  else torch.empty(meta.shape, dtype=meta.dtype, device=device))
        dist.broadcast(tensor, src=src, group=group)
        out[name] = tensor
    return out


def export_weights(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The policy's full (unsharded) weights on every rank: what each rank's generator loads after a step."""
    return get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True))


def build_copy(model_cfg, weights: dict[str, torch.Tensor] | None, *, device: torch.device,
               batch_invariant: bool, dtype: torch.dtype | None = None) -> nn.Module:
    """An unsharded, frozen model holding `weights` (a generator's model, the KL reference), in `dtype`
    (None: the config's). weights None: uninitialised, for a generator whose weights arrive by message."""
    if dtype is not None:
        model_cfg = dataclasses.replace(model_cfg, dtype=dtype)  # the parameters' dtype; buffers keep theirs
    model = build_on_meta(model_cfg).to_empty(device=device)
    model.init_buffers()
    if batch_invariant:
        titan_rl.batch_invariant(model)
    if weights is not None:
        with torch.no_grad():
            model.load_state_dict(weights)
    return model.requires_grad_(False)

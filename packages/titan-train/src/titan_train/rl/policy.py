"""The RL policy on the ranks: built on meta, switched to batch-invariant modules when asked, sharded with
FSDP (torch's fully_shard) over all ranks, then given full weights; plus the unsharded copies that a
generator and a KL reference need.

The model itself is the FSDP root (unlike pretraining, whose root is the fused-loss wrapper): RL needs
per-token logprobs, which come out of the model's own forward (`titan_rl.token_logprobs`), so every
parameter is used inside the root's forward. Batch-invariant mode swaps modules (same parameter names)
and therefore happens before sharding, which tracks parameters by their owning module.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import titan_rl

from ..context_parallel import apply_context_parallel
from ..model_setup import build_on_meta


def initial_weights(model_cfg, *, seed: int) -> dict[str, torch.Tensor]:
    """The initial weights of `model_cfg` on rank 0 ({} elsewhere): what RL starts from without pretraining."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    model = build_on_meta(model_cfg).to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.state_dict()


def build_policy(model_cfg, full_state: dict[str, torch.Tensor], *, device: torch.device,
                 batch_invariant: bool, cp_group: dist.ProcessGroup | None = None) -> nn.Module:
    """The trainable policy: FSDP-sharded over all ranks when there are several, holding `full_state`
    (rank 0's full weights; broadcast to the others' shards); with `cp_group`, its attention is the ring
    of context parallelism over that group (the update then calls it on sequence shares)."""
    model = build_on_meta(model_cfg)
    if batch_invariant:
        titan_rl.batch_invariant(model)
    if cp_group is not None:
        apply_context_parallel(model, cp_group)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if distributed:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    model.init_buffers()  # buffers (RoPE frequencies) are computed, not loaded: to_empty left them uninitialised
    set_model_state_dict(model, full_state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed))
    return model


def export_weights(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The policy's full (unsharded) weights on every rank: what each rank's generator loads after a step."""
    return get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True))


def build_copy(model_cfg, weights: dict[str, torch.Tensor], *, device: torch.device,
               batch_invariant: bool) -> nn.Module:
    """An unsharded, frozen model holding `weights` (a generator's model, the KL reference)."""
    model = build_on_meta(model_cfg).to_empty(device=device)
    model.init_buffers()
    if batch_invariant:
        titan_rl.batch_invariant(model)
    with torch.no_grad():
        model.load_state_dict(weights)
    return model.requires_grad_(False)

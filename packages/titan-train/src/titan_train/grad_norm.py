"""The global gradient norm and clipping over parameters that live on different meshes.

Under expert parallelism the expert gradients are DTensors of the (dp, ep) mesh, the dense ones of the
data-parallel mesh, and the router gates' plain tensors (identical on every rank); DTensor refuses one
foreach norm over several meshes, so each mesh's partial norm is reduced on its own and the results
combined. With one mesh (or none) this is exactly torch's get_total_norm.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `grads` together, the same on every rank."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for mesh, group in by_mesh.items():
        if mesh is None and any(g.dtype in (torch.bfloat16, torch.float16) for g in group):
            # bf16 gradients (mixed_precision=bf16_params): each tensor's norm accumulated and returned in fp32
            norms.append(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32))))
            continue
        norms.append(_mesh_norm(group))
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))


def _mesh_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The whole 2-norm of gradients on one mesh (or plain ones).

    DTensor reduces a norm over several mesh dimensions at once through a flattened mesh of them; where
    the dimensions are not in the root mesh's order (experts under context parallelism: FSDP over the
    flattened (dp_shard_mod_ep, cp), ep between the two) it cannot build one and raises KeyError while
    planning, before any communication. The squares are then summed one sharded dimension at a time."""
    try:
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    except KeyError:
        squared = torch.nn.utils.get_total_norm([g.to_local() for g in grads], foreach=True).float() ** 2
        mesh = grads[0].device_mesh
        for dim, placement in enumerate(grads[0].placements):  # (FSDP's _StridedShard is no Shard)
            assert all(g.placements[dim].is_replicate() == placement.is_replicate() for g in grads)
            if not placement.is_replicate():
                dist.all_reduce(squared, group=mesh.get_group(dim))
        return squared.sqrt().to(grads[0].dtype)


def scale_to_max_norm(with_grad: list[torch.Tensor], max_norm: float, norm: torch.Tensor, *,
                      read_norm: bool = True) -> None:
    """Scale the gradients of `with_grad`, whose global norm is `norm`, so that it is at most `max_norm`.

    read_norm: read the norm on the host (where the step reads it right after anyway): when it is within
    the bound, torch's coefficient max_norm / (norm + 1e-6) would be clamped to 1, and skipping that
    multiplication saves a pass over every gradient on most steps. Without, the clamped coefficient
    multiplies every gradient on the device (by exactly 1 within the bound: the same values, no sync).
    A non-finite norm is left for the caller to refuse."""
    if max_norm <= 0 or (read_norm and not float(norm) + 1e-6 > max_norm):
        return
    by_mesh: dict[object, list[torch.Tensor]] = {}  # DTensor refuses one foreach call across meshes
    for p in with_grad:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)


def clip_by_total_norm(params: list[torch.Tensor], max_norm: float, *, sum_over: dist.ProcessGroup | None = None,
                       read_norm: bool = True) -> torch.Tensor:
    """Scale the gradients of `params` so their global norm is at most `max_norm` (0: leave them); returns the
    norm before clipping. sum_over: a group whose ranks hold other parameters (pipeline stages): the squared
    norms of its ranks are summed. read_norm: see scale_to_max_norm."""
    with_grad = [p for p in params if p.grad is not None]
    norm = total_norm([p.grad for p in with_grad])
    if sum_over is not None:
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=sum_over)
        norm = squared.sqrt()
    scale_to_max_norm(with_grad, max_norm, norm, read_norm=read_norm)
    return norm

"""dispatch / combine: bring routed tokens to their experts' ranks and their outputs back.

Without expert parallelism (no group, or a group of one) dispatch only sorts the slots by expert:
the expert kernels gather x rows themselves, apply the routing weights and sum each token's slots,
so `combine` returns its input.

With an expert-parallel group of P ranks, rank r owns experts [r E/P, (r+1) E/P). dispatch:
sort the slots by expert (stable argsort), count rows per expert, exchange the counts with one
all_to_all_single, read the split sizes on the host (the layer's only host-device sync), gather
the token rows in expert order and exchange them with a second all_to_all_single. The received
rows arrive grouped by (source rank, local expert); the expert computation reads them through
`row_slot` (sorted by local expert) and writes its outputs back in arrival order, so no regrouped
copy is made. combine sends the outputs back (the same splits reversed), puts them in slot order
and sums each token's top_k outputs weighted by its routing weights, in float32.
Every backward step is a deterministic gather or the reverse all-to-all; no scatter-add.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dist_moe.host_sync import read_to_host
from dist_moe.overlap import all_to_all_single


@dataclass(frozen=True)
class _Return:
    """What combine needs to undo an expert-parallel dispatch."""

    group: dist.ProcessGroup
    order: Tensor  # [T*k] slots sorted by expert
    inverse: Tensor  # [T*k] position of each slot in `order`
    send_splits: list[int]
    recv_splits: list[int]
    weights: Tensor  # [T, k]


@dataclass(frozen=True)
class Dispatched:
    """The local experts' input: see `expert_mlp` for the meaning of each field."""

    x: Tensor  # [rows, dim] rows the local experts read (the tokens, or the rows received)
    row_slot: Tensor  # [rows * top_k] int32 slots sorted by local expert
    offsets: Tensor  # [local experts] int32 cumulative row ends
    top_k: int  # slots per row of x
    weights: Tensor | None  # [rows, top_k] routing weights for the expert kernels (None: combine applies them)
    tokens_per_expert: Tensor  # [E] int64 rows this rank routed to each (global) expert
    _return: _Return | None = None


def ep_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def dispatch(x: Tensor, expert_ids: Tensor, weights: Tensor, *, num_experts: int,
             group: dist.ProcessGroup | None = None) -> Dispatched:
    """x [T, dim], expert_ids [T, k] int64, weights [T, k] -> Dispatched (see the module docstring)."""
    if x.dim() != 2 or expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, dim] and expert_ids [T, k]; got {tuple(x.shape)} and "
                         f"{tuple(expert_ids.shape)}")
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights must have expert_ids' shape {tuple(expert_ids.shape)}, got {tuple(weights.shape)}")
    ranks = ep_size(group)
    if num_experts % ranks:
        raise ValueError(f"num_experts={num_experts} must be divisible by the expert-parallel size {ranks}")
    tokens, top_k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [T*k] slots sorted by expert
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype)
    ends = torch.searchsorted(flat[order], bounds[1:])  # [E] cumulative, no host read
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    if ranks == 1:
        return Dispatched(x=x, row_slot=order.to(torch.int32), offsets=ends.to(torch.int32), top_k=top_k,
                          weights=weights, tokens_per_expert=counts)

    local_experts = num_experts // ranks
    recv_counts = torch.empty_like(counts)  # [P * E_local]: rows each source sends to my experts
    all_to_all_single(recv_counts, counts, group=group)
    per_rank = torch.cat([counts.view(ranks, local_experts).sum(1), recv_counts.view(ranks, local_experts).sum(1)])
    sizes = read_to_host(per_rank, "dispatch: all-to-all split sizes")  # the one host-device sync
    send_splits, recv_splits = sizes[:ranks], sizes[ranks:]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    send = _GatherSlots.apply(x, order, inverse, top_k)  # [T*k, dim] token rows in expert order
    received = _AllToAll.apply(send, recv_splits, send_splits, group)  # [R, dim]

    # Arrival order is (source rank, local expert): label each row with its local expert, then
    # sort stably by it to get the rows each local expert reads.
    num_received = sum(recv_splits)
    labels = torch.arange(local_experts, device=flat.device).repeat(ranks)  # [P * E_local]
    local_expert = torch.repeat_interleave(labels, recv_counts, output_size=num_received)  # no host read
    row_slot = torch.argsort(local_expert, stable=True).to(torch.int32)
    offsets = recv_counts.view(ranks, local_experts).sum(0).cumsum(0).to(torch.int32)
    back = _Return(group=group, order=order, inverse=inverse, send_splits=send_splits, recv_splits=recv_splits,
                   weights=weights)
    return Dispatched(x=received, row_slot=row_slot, offsets=offsets, top_k=1, weights=None,
                      tokens_per_expert=counts, _return=back)


def combine(y: Tensor, dispatched: Dispatched) -> Tensor:
    """The experts' output y [rows of dispatched.x, dim] -> [T, dim] for this rank's tokens."""
    back = dispatched._return
    if back is None:
        return y  # the expert kernels already weighted and summed the slots
    returned = _AllToAll.apply(y, back.send_splits, back.recv_splits, back.group)  # [T*k, dim] expert order
    by_slot = _PermuteRows.apply(returned, back.inverse, back.order)  # [T*k, dim] slot order
    tokens, top_k = back.weights.shape
    wide = torch.promote_types(y.dtype, torch.float32)
    weighted = by_slot.view(tokens, top_k, -1).to(wide) * back.weights.unsqueeze(-1).to(wide)
    return weighted.sum(dim=1).to(y.dtype)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; the backward sends gradients the reverse way."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        all_to_all_single(out, x.contiguous(), output_splits=out_splits, input_splits=in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


class _GatherSlots(torch.autograd.Function):
    """x [T, dim] -> x[order // k] [T*k, dim]; backward sums each token's k slot gradients in
    slot order (a gather and a contiguous sum instead of a scatter-add)."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, inverse: Tensor, top_k: int) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.top_k, ctx.tokens = top_k, x.shape[0]
        return x.index_select(0, order // top_k)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        by_slot = grad.index_select(0, inverse)  # [T*k, dim]
        return by_slot.view(ctx.tokens, ctx.top_k, -1).sum(dim=1), None, None, None


class _PermuteRows(torch.autograd.Function):
    """out = x[index] for a permutation `index`; backward gathers with its inverse."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None

"""Context parallelism: the sequence split over the `cp` ranks, attention exchanged around a ring.

Layout (causal load balancing): the sequence is cut into 2 * cp equal chunks and cp rank r holds
chunks r and 2 * cp - 1 - r, so every rank gets the same share of the causal triangle's work. The
trainer shards tokens, labels, positions and document ids this way (`shard_sequence`); everything
outside attention is per token and runs unchanged on the local [b, s / cp] slice.

Attention (`RingAttention`, installed as `layers.*.attention.inner`, and DeepSeek-V3's MTP block's
`mtp.layer.attention.inner`, through `titan_models.override`):
each rank starts with its own K/V and passes them to the next rank while it attends to the ones it
holds, cp steps in all; the partial results are merged with their log-sum-exp (online softmax). The
backward runs the ring again, recomputing each block's probabilities from the saved global
log-sum-exp; the dK/dV of a block travel with that block's K/V and reach their owner after the last
hop. With the load-balanced layout every step but the first touches only half of a block pair: for
a K/V block of an earlier rank all local queries see its first chunk, for a later rank only the
local second chunk sees anything, so no rank waits on another.

Each block is computed by explicit matmuls with fp32 softmax statistics (any mask, any device, so
packed documents are masked exactly: the document ids of all cp ranks are all-gathered once per
forward). A fused flash kernel per block is future work; the exchange does not depend on it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

import titan_models as tm

from .parallelize import matching_modules

# --- the load-balanced layout --------------------------------------------------------------------------


def chunk_size(seq_len: int, cp: int) -> int:
    if seq_len % (2 * cp):
        raise ValueError(f"training.seq_len={seq_len} must be divisible by 2 * parallelism.cp = {2 * cp} "
                         "(causal load balancing cuts the sequence into 2 * cp chunks)")
    return seq_len // (2 * cp)


def local_indices(rank: int, cp: int, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """The global sequence positions cp rank `rank` holds, in its local order: [seq_len / cp]."""
    c = chunk_size(seq_len, cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat((first, second))


def shard_sequence(rank: int, cp: int, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Each [b, s, ...] tensor -> this rank's [b, s / cp, ...] (None passes through)."""
    out = []
    for t in tensors:
        out.append(None if t is None else t.index_select(1, local_indices(rank, cp, t.shape[1], t.device)))
    return out


def unshard_sequence(shards: list[torch.Tensor], cp: int) -> torch.Tensor:
    """The inverse of shard_sequence over all cp ranks' [b, s / cp, ...] shards -> [b, s, ...] (tests, tools)."""
    seq = shards[0].shape[1] * cp
    full = shards[0].new_empty((shards[0].shape[0], seq, *shards[0].shape[2:]))
    for rank, shard in enumerate(shards):
        full[:, local_indices(rank, cp, seq, shard.device)] = shard
    return full


# --- one block pair: local queries x one rank's keys ---------------------------------------------------
# Shapes: q [b, hkv, g, sq, d] (g = hq / hkv query heads per K/V head), k [b, hkv, 1, sk, d],
# v [b, hkv, 1, sk, dv], mask broadcastable to [b, 1, 1, sq, sk] (True = may attend) or None,
# out [b, hkv, g, sq, dv], lse [b, hkv, g, sq]. Products run in the inputs' dtype (bf16 on GPUs, like a
# flash kernel's), softmax statistics and accumulators in fp32 (fp64 for fp64 inputs); the scores are
# computed a chunk of query rows at a time, so at most _SCORE_ELEMENTS of them exist at once.

_SCORE_ELEMENTS = 1 << 26  # 256 MiB of fp32 scores


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _row_chunks(q: torch.Tensor, k: torch.Tensor):
    b, hkv, g, sq, _ = q.shape
    rows = max(1, _SCORE_ELEMENTS // max(1, b * hkv * g * k.shape[-2]))
    for start in range(0, sq, rows):
        yield slice(start, min(start + rows, sq))


def _scores(q, k, scale, mask):
    s = torch.matmul(q, k.transpose(-1, -2)).to(_acc(q)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """A row that may attend to nothing has lse -inf; exp(s - lse) must then be 0, not nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _rows_of(mask, rows):
    return None if mask is None else mask[..., rows, :]


def _block_forward(q, k, v, scale, mask):
    acc = _acc(q)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=acc)
    lse = q.new_empty(q.shape[:-1], dtype=acc)
    for rows in _row_chunks(q, k):
        s = _scores(q[..., rows, :], k, scale, _rows_of(mask, rows))
        lse[..., rows] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - _finite(lse[..., rows])[..., None])
        out[..., rows, :] = torch.matmul(p.to(v.dtype), v).to(acc)
    return out, lse


def _block_backward(q, k, v, scale, mask, dout, lse, delta):
    """Gradients of one block given the *final* lse (so p is the block's share of the global softmax) and
    delta = rowsum(dO * O). Returns dq [b, hkv, g, sq, d], dk [b, hkv, 1, sk, d], dv [b, hkv, 1, sk, dv]
    in the accumulation dtype."""
    acc = _acc(q)
    dq = q.new_empty(q.shape, dtype=acc)
    dk, dv = k.new_zeros(k.shape, dtype=acc), v.new_zeros(v.shape, dtype=acc)
    for rows in _row_chunks(q, k):
        s = _scores(q[..., rows, :], k, scale, _rows_of(mask, rows))
        p = torch.exp(s - _finite(lse[..., rows])[..., None])      # [b, hkv, g, rows, sk]
        do = dout[..., rows, :]
        dv += torch.matmul(p.to(v.dtype).transpose(-1, -2), do).to(acc).sum(2, keepdim=True)
        dp = torch.matmul(do, v.transpose(-1, -2)).to(acc)
        ds = p * (dp - delta[..., rows, None]) * scale
        dq[..., rows, :] = torch.matmul(ds.to(q.dtype), k).to(acc)
        dk += torch.matmul(ds.to(q.dtype).transpose(-1, -2), q[..., rows, :]).to(acc).sum(2, keepdim=True)
    return dq, dk, dv


def _merge(out, lse, block_out, block_lse):
    """Online softmax: combine two partial attentions over disjoint key sets (in place into out/lse)."""
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    out.mul_(torch.exp(lse - safe)[..., None]).add_(block_out * torch.exp(block_lse - safe)[..., None])
    lse.copy_(new)


class _Pairing:
    """Which local query rows and which key columns of rank `source`'s block can interact, for the
    load-balanced layout (see the module docstring), and the mask within them."""

    def __init__(self, rank: int, source: int, cp: int, local_len: int, docs: list[torch.Tensor] | None,
                 device: torch.device):
        half = local_len // 2
        seq_len = local_len * cp
        if source == rank:        # own block: causal within each chunk, second chunk sees all of the first
            self.rows, self.cols = slice(None), slice(None)
        elif source < rank:       # an earlier rank: every local query sees its first chunk only
            self.rows, self.cols = slice(None), slice(0, half)
        else:                     # a later rank: only the local second chunk sees anything, all of it
            self.rows, self.cols = slice(half, None), slice(None)
        mask = None
        if source == rank:
            idx = local_indices(rank, cp, seq_len, device)
            mask = idx[:, None] >= idx[None, :]                     # [sq, sk]
        if docs is not None:
            q_doc, k_doc = docs[rank][:, self.rows], docs[source][:, self.cols]
            same = q_doc[:, :, None] == k_doc[:, None, :]            # [b, sq, sk]
            mask = same if mask is None else same & mask
        # -> broadcastable to [b, hkv, g, sq, sk]
        self.mask = None if mask is None else (mask[:, None, None] if mask.dim() == 3 else mask)


def _ring_exchange(send: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, list]:
    """Start sending `send` to the next cp rank and receiving the previous rank's into a new buffer."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % size), group),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % size), group)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _ring_forward(q, k, v, scale: float, group: ProcessGroup, docs: list[torch.Tensor] | None):
    """q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv] (this rank's tokens) -> out [b, sq, hq, dv]
    and the log-sum-exp [b, hkv, hq / hkv, sq] of every query over all keys."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    b, local_len, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    qh = q.permute(0, 2, 1, 3).reshape(b, hkv, hq // hkv, local_len, d)
    out = q.new_zeros((b, hkv, hq // hkv, local_len, dv), dtype=_acc(q))
    lse = q.new_full((b, hkv, hq // hkv, local_len), float("-inf"), dtype=_acc(q))
    kv = torch.cat((k, v), dim=-1)                               # [b, sk, hkv, d + dv]: one message per hop
    for step in range(cp):
        source = (rank - step) % cp
        if step < cp - 1:
            incoming, works = _ring_exchange(kv, group)
        pair = _Pairing(rank, source, cp, local_len, docs, q.device)
        kh = kv[..., :d].permute(0, 2, 1, 3)[:, :, None, pair.cols]   # [b, hkv, 1, sk', d]
        vh = kv[..., d:].permute(0, 2, 1, 3)[:, :, None, pair.cols]
        block_out, block_lse = _block_forward(qh[..., pair.rows, :], kh, vh, scale, pair.mask)
        _merge(out[..., pair.rows, :], lse[..., pair.rows], block_out, block_lse)  # views: in place
        if step < cp - 1:
            _wait(works)
            kv = incoming
    return out.reshape(b, hq, local_len, dv).permute(0, 2, 1, 3).to(q.dtype), lse


def _ring_backward(q, k, v, result, lse, dout, scale: float, group: ProcessGroup, docs: list[torch.Tensor] | None):
    """dq, dk, dv of _ring_forward's output, running the ring again: K/V and their gradients travel."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    b, local_len, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    g = hq // hkv
    qh = q.permute(0, 2, 1, 3).reshape(b, hkv, g, local_len, d)
    acc = _acc(q)
    douth = dout.permute(0, 2, 1, 3).reshape(b, hkv, g, local_len, dv).to(q.dtype)
    outh = result.permute(0, 2, 1, 3).reshape(b, hkv, g, local_len, dv)
    delta = (douth.to(acc) * outh.to(acc)).sum(-1)              # [b, hkv, g, sq]: rowsum(dO * O)
    dq = torch.zeros_like(qh, dtype=acc)
    kv = torch.cat((k, v), dim=-1)
    dkv = torch.zeros_like(kv, dtype=acc)                       # the gradient of the block held now
    for step in range(cp):
        source = (rank - step) % cp
        if step < cp - 1:
            incoming, works = _ring_exchange(kv, group)         # K/V for the next step, during compute
        pair = _Pairing(rank, source, cp, local_len, docs, q.device)
        kh = kv[..., :d].permute(0, 2, 1, 3)[:, :, None, pair.cols]
        vh = kv[..., d:].permute(0, 2, 1, 3)[:, :, None, pair.cols]
        bq, bk, bv = _block_backward(qh[..., pair.rows, :], kh, vh, scale, pair.mask, douth[..., pair.rows, :],
                                     lse[..., pair.rows], delta[..., pair.rows])
        dq[..., pair.rows, :] += bq
        # [b, hkv, 1, sk', d] -> [b, sk', hkv, d]
        dkv[:, pair.cols, :, :d] += bk[:, :, 0].permute(0, 2, 1, 3)
        dkv[:, pair.cols, :, d:] += bv[:, :, 0].permute(0, 2, 1, 3)
        # dK/dV follow their block one hop; after the last step the hop ends at the block's owner.
        if cp > 1:
            dkv, dkv_works = _ring_exchange(dkv, group)
            _wait(dkv_works)
        if step < cp - 1:
            _wait(works)
            kv = incoming
    dq = dq.reshape(b, hq, local_len, d).permute(0, 2, 1, 3).to(q.dtype)
    return dq, dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype)


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, group: ProcessGroup, docs: list[torch.Tensor] | None):
        with torch.autocast(q.device.type, enabled=False):  # products in q's dtype, statistics in fp32
            result, lse = _ring_forward(q, k, v, scale, group, docs)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.scale, ctx.group, ctx.docs = scale, group, docs
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, result, lse = ctx.saved_tensors
        with torch.autocast(dout.device.type, enabled=False):
            dq, dk, dv = _ring_backward(q, k, v, result, lse, dout, ctx.scale, ctx.group, ctx.docs)
        return dq, dk, dv, None, None, None


def _gather_documents(document_ids: torch.Tensor, group: ProcessGroup) -> list[torch.Tensor]:
    """Every cp rank's local document ids [b, s / cp], in rank order (int64, tiny)."""
    ids = document_ids.contiguous()
    parts = [torch.empty_like(ids) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, ids, group=group)
    return parts


class RingAttention(nn.Module):
    """An inner attention (`inner(q, k, v, *, context)`, see titan-models) over a sequence sharded across
    the cp group in the load-balanced layout: causal, plus the document mask of `context.document_ids`
    (this rank's [b, s / cp] ids). q [b, s / cp, hq, d], k/v [b, s / cp, hkv, d] -> [b, s / cp, hq, dv]."""

    def __init__(self, *, scale: float, group: ProcessGroup):
        super().__init__()
        self.scale, self.group = scale, group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                context: tm.AttentionContext | None = None) -> torch.Tensor:
        docs = None
        if context is not None and context.document_ids is not None:
            ids = context.document_ids
            # One all-gather per forward: every layer reuses it (a fresh context per forward).
            docs = context.cached(("cp_document_ids", ids.shape, ids.device),
                                  lambda: _gather_documents(ids, self.group))
        if torch.is_autocast_enabled(q.device.type):  # as SDPA under autocast: all three in the autocast dtype
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        elif not q.dtype == k.dtype == v.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        return _RingAttentionFunction.apply(q, k, v, self.scale, self.group, docs)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.6g}, cp={dist.get_world_size(self.group)}"


# the attentions a sequence passes through: the blocks', and DeepSeek-V3's multi-token-prediction block's
# (it attends over the same sharded sequence; present on a pipeline's last stage only)
CONTEXT_PARALLEL_ATTENTION = ("layers.*.attention.inner", "mtp.layer.attention.inner")


def apply_context_parallel(model: nn.Module, group: ProcessGroup) -> list[str]:
    """Replace every attention's inner product of `model` (CONTEXT_PARALLEL_ATTENTION) with RingAttention
    over `group` (same scale). Returns the replaced module names."""
    def ring(name: str, old: nn.Module) -> nn.Module:
        scale = getattr(old, "scale", None)
        if scale is None:
            raise ValueError(f"context parallelism needs the attention scale of {name} "
                             f"({type(old).__name__} has no `scale`)")
        attention = model.get_submodule(name.rpartition(".")[0])
        if getattr(old, "sliding_window", None) is not None or getattr(attention, "sinks", None) is not None:
            raise ValueError(f"context parallelism does not support sliding windows or attention sinks yet "
                             f"({name}, gpt-oss); use parallelism.cp=1")
        return RingAttention(scale=scale, group=group)

    replaced = tm.override(model, CONTEXT_PARALLEL_ATTENTION[0], ring)
    for pattern in CONTEXT_PARALLEL_ATTENTION[1:]:
        if matching_modules(model, pattern):
            replaced += tm.override(model, pattern, ring)
    return replaced


def check_context_parallel(*, cp: int, tp: int, seq_len: int) -> None:
    chunk_size(seq_len, cp)
    if (seq_len // cp) % tp:
        raise ValueError(f"training.seq_len / parallelism.cp = {seq_len // cp} must be divisible by "
                         f"parallelism.tp = {tp} (sequence parallel splits each cp rank's tokens further)")

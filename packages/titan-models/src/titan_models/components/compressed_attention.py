"""DeepSeek-V4 attention: one shared key=value head over a sliding window plus compressed entries.

Every layer attends with `num_heads` query heads to one key/value head (the same tensor is key and
value) over the last `sliding_window` tokens, with per-head sinks. Compressed layers add entries:
each window of `rate` positions is pooled into one entry (a softmax over the window's tokens of a
learned gate plus a per-offset bias `ape`, then an RMSNorm and RoPE at the window's first position).
- heavily compressed attention (HCA, large rate): every visible entry is attended.
- compressed sparse attention (CSA, small rate): windows overlap (each entry also pools the previous
  window's tokens through a second projection half), and a lightning indexer (its own smaller
  compressor, `index_n_heads` ReLU scores weighted per token) keeps the `index_topk` best entries.
RoPE rotates the trailing `rope_dim` channels as interleaved pairs; because values carry that rotation
too, the output is rotated back at the query's position. The output projection is low-rank per group
of heads (`o_groups` x `o_lora_rank`).

Causality (unlike the reference, which counts windows from the forward's first token): windows are
cut by *position* within each packed document, and an entry is visible to a query only when the
query's position has reached the window's last position, in the same document. So later tokens never
change earlier outputs, for any starting position and with packed documents; for one 0-based
document this is the reference's computation.

Decode state: with `context.recurrent_states` set (a generator's dict, kept from prefill through decode)
each layer keeps a `CompressedAttentionCache` there: its inputs and rotated keys=values by position slot.
A call then attends from its new tokens over every slot up to their positions; the compressed entries
(and the indexer's keys) are pooled again from the cached inputs on every call, so an entry appears as
soon as its window completes. Slot = position: decode starts each row at position 0, and every slot up
to a query's position holds that row's token (right padding of a prompt sits past it until decode
overwrites it). Packed documents are not carried in decode state (refused).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.components.attention_masks import dense_mask
from titan_models.components.hyper_connections import unweighted_rms_norm
from titan_models.components.norms import RMSNorm
from titan_models.components.rope import RotaryEmbedding
from titan_models.components.sinks import AttentionSinks, eager_attention
from titan_models.context import AttentionContext

ATTENTION_KINDS: tuple[str, ...] = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def rotate_trailing_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, s, heads, d]; cos/sin [b, s, rot] as RotaryEmbedding gives them (frequencies repeated
    twice). Rotates the pairs (2i, 2i+1) of the last `rot` channels in place, in float32."""
    rot = cos.shape[-1]
    cos = cos[..., : rot // 2].repeat_interleave(2, dim=-1).unsqueeze(2)
    sin = sin[..., : rot // 2].repeat_interleave(2, dim=-1).unsqueeze(2)
    keep, rope = x[..., :-rot], x[..., -rot:].float()
    pairs = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([keep, (rope * cos + pairs * sin).to(x.dtype)], dim=-1)


@dataclass(frozen=True)
class Windows:
    """How a forward's tokens fall into compression windows of `rate` positions (per document)."""

    rate: int
    slot: torch.Tensor  # [b, s] the entry each token pools into
    offset: torch.Tensor  # [b, s] position % rate (the row of `ape`)
    next_ok: torch.Tensor  # [b, s] the entry after the token's is the next window of its document
    entry_position: torch.Tensor  # [b, n] first position of each entry's window
    visible: torch.Tensor  # [b, s, n] query may read entry: same document, window complete by its position

    @staticmethod
    def of(positions: torch.Tensor, document_ids: torch.Tensor | None, rate: int) -> "Windows":
        doc = torch.zeros_like(positions) if document_ids is None else document_ids
        window = positions // rate
        start = torch.ones_like(positions, dtype=torch.bool)
        start[:, 1:] = (window[:, 1:] != window[:, :-1]) | (doc[:, 1:] != doc[:, :-1])
        slot = start.long().cumsum(1) - 1
        n = int(slot[:, -1].max()) + 1
        entry_window = torch.full_like(slot[:, :n], -1).scatter(1, slot, window)
        entry_doc = torch.full_like(slot[:, :n], -1).scatter(1, slot, doc)
        following = (slot + 1).clamp(max=n - 1)
        next_ok = ((slot + 1 < n) & (entry_window.gather(1, following) == window + 1)
                   & (entry_doc.gather(1, following) == doc))
        visible = ((entry_window >= 0)[:, None, :] & (entry_doc[:, None, :] == doc[:, :, None])
                   & ((entry_window[:, None, :] + 1) * rate <= positions[:, :, None] + 1))
        return Windows(rate=rate, slot=slot, offset=positions % rate, next_ok=next_ok,
                       entry_position=entry_window.clamp(min=0) * rate, visible=visible)


def pool(logits: torch.Tensor, values: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, n: int
         ) -> torch.Tensor:
    """Softmax-weighted sums per target entry: rows [b, r, d] with their entry [b, r] -> [b, n, d]."""
    b, _, d = logits.shape
    logits = logits.float().masked_fill(~valid[..., None], float("-inf"))
    index = target[..., None].expand(-1, -1, d)
    peak = logits.new_full((b, n, d), float("-inf")).scatter_reduce(1, index, logits, "amax")
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    weights = (logits - peak.gather(1, index)).exp()
    total = logits.new_zeros((b, n, d)).scatter_add(1, index, weights)
    summed = logits.new_zeros((b, n, d)).scatter_add(1, index, weights * values.float())
    return (summed / total.clamp_min(torch.finfo(total.dtype).tiny)).to(values.dtype)


class Compressor(nn.Module):
    """x [b, s, dim] -> entries [b, n, head_dim], one per window (see the module docstring)."""

    def __init__(self, dim: int, *, head_dim: int, rate: int, overlap: bool, norm_eps: float):
        super().__init__()
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        width = head_dim * (2 if overlap else 1)
        self.wkv = nn.Linear(dim, width, bias=False)
        self.wgate = nn.Linear(dim, width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, width))
        self.norm = RMSNorm(head_dim, eps=norm_eps)

    def init_parameter(self, name: str, param: torch.Tensor, generator: torch.Generator) -> bool:
        if name == "ape":
            param.zero_()
            return True
        return False

    def forward(self, x: torch.Tensor, windows: Windows, rope: RotaryEmbedding) -> torch.Tensor:
        kv, gate = self.wkv(x), self.wgate(x) + self.ape[windows.offset]
        n = windows.entry_position.shape[1]
        d = self.head_dim
        if self.overlap:  # second half: this window's entry; first half: the next window's
            logits = torch.cat([gate[..., d:], gate[..., :d]], dim=1)
            values = torch.cat([kv[..., d:], kv[..., :d]], dim=1)
            target = torch.cat([windows.slot, (windows.slot + 1).clamp(max=n - 1)], dim=1)
            valid = torch.cat([torch.ones_like(windows.next_ok), windows.next_ok], dim=1)
        else:
            logits, values, target, valid = gate, kv, windows.slot, torch.ones_like(windows.next_ok)
        entries = self.norm(pool(logits, values, target, valid, n))
        cos, sin = rope(windows.entry_position)
        return rotate_trailing_pairs(entries.unsqueeze(2), cos, sin).squeeze(2)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rate={self.rate}, overlap={self.overlap}"


class Indexer(nn.Module):
    """Picks, per query, the `topk` visible entries of highest sum_h w_h(x) * relu(q_h . k) (lightning indexer)."""

    def __init__(self, dim: int, *, q_lora_rank: int, num_heads: int, head_dim: int, rate: int, topk: int,
                 norm_eps: float):
        super().__init__()
        self.num_heads, self.head_dim, self.topk = num_heads, head_dim, topk
        self.compressor = Compressor(dim, head_dim=head_dim, rate=rate, overlap=True, norm_eps=norm_eps)
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(dim, num_heads, bias=False)

    def forward(self, x: torch.Tensor, q_residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                windows: Windows, entry_rope: RotaryEmbedding, *, history: torch.Tensor | None = None,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        """-> [b, s, n] bool: the entries each query (a row of x) reads. Decode: the keys pool `history`
        (the cached inputs that `windows` cuts) and `visible` [b, s, n] says which entries each query sees."""
        b, s, _ = x.shape
        keys = self.compressor(x if history is None else history, windows, entry_rope)  # [b, n, d]
        visible = windows.visible if visible is None else visible
        q = rotate_trailing_pairs(self.wq_b(q_residual).view(b, s, -1, self.head_dim), *rope)
        scores = F.relu(torch.einsum("bshd,bnd->bshn", q.float(), keys.float())) * self.head_dim**-0.5
        weights = self.weights_proj(x).float() * self.num_heads**-0.5  # [b, s, h]
        scores = (scores * weights[..., None]).sum(dim=2).masked_fill(~visible, float("-inf"))
        chosen = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices
        return torch.zeros_like(visible).scatter(-1, chosen, True) & visible


@dataclass(frozen=True)
class CompressedAttentionCache:
    """One layer's decode state: x [b, L, dim] its inputs and kv [b, L, d] its rotated keys=values, by
    position slot (L: one past the highest position written)."""

    x: torch.Tensor
    kv: torch.Tensor

    @staticmethod
    def written(cache: "CompressedAttentionCache | None", positions: torch.Tensor, x: torch.Tensor,
                kv: torch.Tensor) -> "CompressedAttentionCache":
        """`cache` (None: empty) with x [b, s, dim] and kv [b, s, d] stored at slots `positions` [b, s]."""
        b, _, dim = x.shape
        slots = int(positions.max()) + 1
        if cache is None:
            cache = CompressedAttentionCache(x=x.new_zeros(b, 0, dim), kv=kv.new_zeros(b, 0, kv.shape[-1]))
        grow = max(slots - cache.x.shape[1], 0)
        cache_x = F.pad(cache.x, (0, 0, 0, grow))
        cache_kv = F.pad(cache.kv, (0, 0, 0, grow))
        index = positions[..., None]
        cache_x = cache_x.scatter(1, index.expand(-1, -1, dim), x)
        cache_kv = cache_kv.scatter(1, index.expand(-1, -1, kv.shape[-1]), kv)
        return CompressedAttentionCache(x=cache_x, kv=cache_kv)


@dataclass(kw_only=True, frozen=True)
class CompressedAttentionConfig:
    kind: str  # one of ATTENTION_KINDS
    num_heads: int
    head_dim: int
    rope_dim: int  # trailing channels of each head that rotate
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_rate: int = 0  # positions per entry (compressed kinds)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    norm_eps: float = 1e-6

    def build(self, dim: int) -> "CompressedAttention":
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"layer_types entry {self.kind!r} is not one of {list(ATTENTION_KINDS)}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"o_groups ({self.o_groups}) must divide num_heads * head_dim "
                             f"({self.num_heads * self.head_dim})")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= min(self.head_dim, self.index_head_dim or self.head_dim):
            raise ValueError(f"the rotated width {self.rope_dim} (head_dim * partial_rotary_factor) must be even "
                             f"and at most head_dim ({self.head_dim}) and index_head_dim ({self.index_head_dim})")
        if self.kind != "sliding_attention" and self.compress_rate < 1:
            raise ValueError(f"compress_rates needs a rate >= 1 for {self.kind}, got {self.compress_rate}")
        return CompressedAttention(dim, self)


class CompressedAttention(nn.Module):
    def __init__(self, dim: int, config: CompressedAttentionConfig):
        super().__init__()
        self.config = config
        h, d = config.num_heads, config.head_dim
        self.score_dims = (h, d, d)  # for FLOP counting (the sliding part; entries are few)
        self.sliding_window = config.sliding_window
        self.wq_a = nn.Linear(dim, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, eps=config.norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, h * d, bias=False)
        self.wkv = nn.Linear(dim, d, bias=False)
        self.kv_norm = RMSNorm(d, eps=config.norm_eps)
        self.wo_a = nn.Linear(h * d // config.o_groups, config.o_groups * config.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(config.o_groups * config.o_lora_rank, dim, bias=False)
        self.sinks = AttentionSinks(h)
        compressed = config.kind != "sliding_attention"
        self.compressor = Compressor(dim, head_dim=d, rate=config.compress_rate,
                                     overlap=config.kind == "compressed_sparse_attention",
                                     norm_eps=config.norm_eps) if compressed else None
        self.indexer = Indexer(dim, q_lora_rank=config.q_lora_rank, num_heads=config.index_n_heads,
                               head_dim=config.index_head_dim, rate=config.compress_rate, topk=config.index_topk,
                               norm_eps=config.norm_eps) if config.kind == "compressed_sparse_attention" else None

    def keys_per_query(self, seq_len: int) -> int:
        """For FLOP counting: the window's keys plus the compressed entries a query reads (at most)."""
        cfg = self.config
        entries = 0 if self.compressor is None else seq_len // cfg.compress_rate
        if self.indexer is not None:
            entries = min(entries, cfg.index_topk)
        return min(seq_len, cfg.sliding_window) + entries

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], *, positions: torch.Tensor,
                entry_rope: RotaryEmbedding, context: AttentionContext | None = None) -> torch.Tensor:
        """x [b, s, dim]; rope: this layer's (cos, sin) at `positions` [b, s]; entry_rope places entries."""
        if context is not None and context.recurrent_states is not None:
            return self._decode(x, rope, positions, entry_rope, context)
        b, s, _ = x.shape
        cfg = self.config
        q_residual, q, kv = self._project(x, rope)
        document_ids = None if context is None else context.document_ids
        mask = dense_mask(s, x.device, window=cfg.sliding_window, document_ids=document_ids).expand(b, 1, s, s)
        if self.compressor is not None:
            windows = Windows.of(positions, document_ids, cfg.compress_rate)
            entries = self.compressor(x, windows, entry_rope)  # [b, n, d]
            reads = windows.visible if self.indexer is None else self.indexer(x, q_residual, rope, windows, entry_rope)
            kv = torch.cat([kv, entries.unsqueeze(2)], dim=1)
            mask = torch.cat([mask, reads.unsqueeze(1)], dim=-1)
        return self._attend(q, kv, mask, rope)

    def _project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the query's low-rank residual [b, s, q_lora_rank], rotated queries [b, s, h, d], keys=values [b, s, 1, d])."""
        b, s, _ = x.shape
        cfg = self.config
        q_residual = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_residual).view(b, s, -1, cfg.head_dim), cfg.norm_eps)
        q = rotate_trailing_pairs(q, *rope)
        kv = rotate_trailing_pairs(self.kv_norm(self.wkv(x)).unsqueeze(2), *rope)  # [b, s, 1, d]
        return q_residual, q, kv

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        """Attention of q [b, s, h, d] over kv [b, keys, 1, d] where mask [b, 1, s, keys], then the output path."""
        cfg = self.config
        b, s = q.shape[:2]
        out = eager_attention(q, kv, kv, scale=cfg.head_dim**-0.5, mask=mask, sinks=self.sinks())
        cos, sin = rope
        out = rotate_trailing_pairs(out, cos, -sin)  # values carried the keys' rotation: undo it per query
        grouped = out.reshape(b, s, cfg.o_groups, -1)
        weight = self.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, -1)
        return self.wo_b(torch.einsum("bsgi,goi->bsgo", grouped, weight).flatten(2))

    def _decode(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                entry_rope: RotaryEmbedding, context: AttentionContext) -> torch.Tensor:
        """The new tokens x [b, s, dim] at `positions` over this layer's cache (see the module docstring)."""
        if context.document_ids is not None:
            raise ValueError("DeepSeek-V4 attention keeps no decode state across packed documents "
                             "(context.document_ids with recurrent_states); decode one document per row")
        cfg = self.config
        q_residual, q, kv = self._project(x, rope)
        states = context.recurrent_states
        cache = states[self] = CompressedAttentionCache.written(states.get(self), positions, x, kv.squeeze(2))
        b, slots = cache.x.shape[:2]
        slot, pos = torch.arange(slots, device=x.device), positions[:, :, None]
        mask = ((slot <= pos) & (pos - slot < cfg.sliding_window))[:, None]  # [b, 1, s, L]
        keys = cache.kv.unsqueeze(2)
        if self.compressor is not None:
            windows = Windows.of(slot.expand(b, slots), None, cfg.compress_rate)  # over every slot
            visible = windows.visible.gather(1, pos.expand(-1, -1, windows.visible.shape[-1]))  # the queries' rows
            entries = self.compressor(cache.x, windows, entry_rope)
            reads = visible if self.indexer is None else self.indexer(x, q_residual, rope, windows, entry_rope,
                                                                      history=cache.x, visible=visible)
            keys = torch.cat([keys, entries.unsqueeze(2)], dim=1)
            mask = torch.cat([mask, reads.unsqueeze(1)], dim=-1)
        return self._attend(q, keys, mask, rope)

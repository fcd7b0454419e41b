"""Batch-invariant ops in plain torch (CPU, and any device without Triton).

"Batch-invariant" means: a row's result is bitwise the same whatever other rows share the call and
however many there are. Three facts about torch on CPU (checked by tests/test_batch_invariant.py on
the machine that runs them) shape these implementations:

- GEMM (MKL/oneDNN) picks kernels and blockings by problem size: `x[:1] @ w` and `x[:9] @ w` give
  different bits for row 0 (gemv for one row, small-M paths), and on some CPUs (AVX-512/AMX Xeons)
  `x[:16] @ w` and `x[:64] @ w` differ too. `matmul` therefore pads the rows to a multiple of MATMUL_TILE
  and multiplies one MATMUL_TILE-row tile per call: every call has the same shape, so every row gets the
  same kernel and reduction order over K whatever the batch.
- Reductions (`sum`, `mean`) choose their order from the tensor's size and layout, and may split
  a reduction across threads; `tree_sum` instead adds fixed halves elementwise (a reduction order
  fixed by the reduced length alone, independent of the other dimensions and of threading).
- Elementwise kernels compute the trailing `numel % vector_width` elements (and every thread-chunk
  boundary) with a scalar loop; for `rsqrt`, `sigmoid` and `silu` that loop rounds differently from the
  vector body, so an element's bits depend on where it lands. These ops avoid them: `1 / sqrt` and
  `x / (1 + exp(-x))` use only correctly rounded IEEE operations and `exp`, whose scalar and vector
  paths agree.

Attention walks the keys in fixed blocks of KEY_BLOCK from slot 0 with an online softmax: keys past
a query's position are masked to probability exactly 0, and a block that is entirely masked leaves
the running max, sum and accumulator bitwise unchanged (scale 1.0, add 0.0), so a query's result
does not depend on how many keys (or padding) follow it. A sliding window masks the slots before
position - window + 1 the same way; attention sinks (a per-head logit in the denominator) join each
row's softmax after the last block, in the same fixed order for every row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 8
MATMUL_TILE = 32  # rows per GEMM call of `matmul` (fixed: the call's shape must not depend on the batch)
KEY_BLOCK = 64


def _pad_rows(x: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    rows = x.shape[-2]
    pad = (-rows) % multiple
    if rows == 0:
        pad = multiple
    return (F.pad(x, (0, 0, 0, pad)) if pad else x), rows


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] (a Linear without bias), one MATMUL_TILE-row GEMM per tile."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    padded, rows = _pad_rows(flat, MATMUL_TILE)
    tiles = [F.linear(tile, weight) for tile in padded.split(MATMUL_TILE)]
    return torch.cat(tiles)[:rows].reshape(*lead, weight.shape[0])


def tree_sum(x: torch.Tensor, *, keepdim: bool = False) -> torch.Tensor:
    """Sum over the last dim by pairwise halving (zero-padded to a power of two): the order of the
    additions depends only on the last dim's length."""
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = F.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x if keepdim else x.squeeze(-1)


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    mean_square = tree_sum(xf * xf, keepdim=True) / x.shape[-1]
    normed = xf / torch.sqrt(mean_square + eps)
    return weight * normed.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """Batch-invariant forward; the backward (which no generator compares against) recomputes with
    torch's fused rms_norm, several times cheaper than differentiating through the tree reduction."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _rms_norm_forward(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x, w = x.detach().requires_grad_(), weight.detach().requires_grad_()
            ref = w * F.rms_norm(x.float(), (x.shape[-1],), eps=ctx.eps).to(x.dtype)
            gx, gw = torch.autograd.grad(ref, (x, w), grad)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Computed in float32 and cast back before the weight (the rounding titan-models' RMSNorm uses)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return _rms_norm_forward(x, weight, eps)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Over the last dim, in float32 (or wider)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    shifted = x - x.amax(dim=-1, keepdim=True).detach()  # max is exact in any order
    return shifted - torch.log(tree_sum(torch.exp(shifted), keepdim=True))


def softmax(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    e = torch.exp(x - x.amax(dim=-1, keepdim=True).detach())
    return e / tree_sum(e, keepdim=True)


def _visible(q_positions: torch.Tensor, L: int, kv_len: torch.Tensor | None, window: int | None = None
             ) -> torch.Tensor:
    """[b, 1, s, L] bool: key slot j is visible to a query at position p iff j <= p (and j < kv_len,
    and p - j < window)."""
    limit = q_positions if kv_len is None else torch.minimum(q_positions, kv_len[:, None] - 1)
    slots = torch.arange(L, device=q_positions.device)[None, None, :]
    visible = slots <= limit[:, :, None]
    if window is not None:
        visible = visible & (q_positions[:, :, None] - slots < window)
    return visible[:, None]


class _Attention(torch.autograd.Function):
    """Batch-invariant forward; backward by recomputing with torch's SDPA (not compared with anything,
    and much cheaper than differentiating through the blocked loop)."""

    @staticmethod
    def forward(ctx, q, k, v, q_positions, kv_len, scale, window=None, sinks=None):
        ctx.save_for_backward(q, k, v, q_positions, kv_len, sinks)
        ctx.scale, ctx.window = scale, window
        return _attention_forward(q, k, v, q_positions=q_positions, scale=scale, kv_len=kv_len, window=window,
                                  sinks=sinks)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, q_positions, kv_len, sinks = ctx.saved_tensors
        if sinks is None:
            grads = sdpa_attention_grad(q, k, v, q_positions, kv_len, ctx.scale, grad, window=ctx.window)
            return (*grads, None, None, None, None, None)
        gq, gk, gv, gsinks = eager_sink_grad(q, k, v, sinks, q_positions, kv_len, ctx.scale, ctx.window, grad)
        return gq, gk, gv, None, None, None, None, gsinks


def sdpa_attention_grad(q, k, v, q_positions, kv_len, scale, grad, *, window=None):
    """Gradients of the attention contract (same mask) through torch's SDPA, for q, k, v."""
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        mask = _visible(q_positions, k.shape[1], kv_len, window)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
        return torch.autograd.grad(out, (q, k, v), grad)


def eager_sink_grad(q, k, v, sinks, q_positions, kv_len, scale, window, grad):
    """Gradients for q, k, v and the sinks through titan-models' eager sink attention (same mask)."""
    from titan_models.components.sinks import eager_attention

    with torch.enable_grad():
        q, k, v, sinks = (t.detach().requires_grad_() for t in (q, k, v, sinks))
        mask = _visible(q_positions, k.shape[1], kv_len, window)
        out = eager_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
        return torch.autograd.grad(out, (q, k, v, sinks), grad)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_positions: torch.Tensor,
              scale: float, kv_len: torch.Tensor | None = None, window: int | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention by position over key slots.

    q [b, s, hq, d]; k, v [b, L, hkv, d] where key slot j holds position j; q_positions [b, s].
    Query (i, position p) attends slots j <= p (and j < kv_len[b] if given, and p - j < window if
    given), with sinks [hq] in the softmax denominator if given. Returns [b, s, hq, d_v] in q's dtype;
    softmax statistics and the accumulator are float32.
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        return _Attention.apply(q, k, v, q_positions, kv_len, scale, window, sinks)
    return _attention_forward(q, k, v, q_positions=q_positions, scale=scale, kv_len=kv_len, window=window,
                              sinks=sinks)


def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_positions: torch.Tensor,
                       scale: float, kv_len: torch.Tensor | None = None, window: int | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """See `attention`: blocks of KEY_BLOCK keys from slot 0, online softmax, sinks joined last."""
    b, s, hq, d = q.shape
    L, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    # rows of one (batch, kv-head) problem: the g query heads sharing that kv head, times s queries
    qh = q.permute(0, 2, 1, 3).reshape(b, hkv, g * s, d)            # [b, hkv, g*s, d]
    qh, rows = _pad_rows(qh, ROW_TILE)                               # [b, hkv, R, d]
    R = qh.shape[2]
    row_pos = q_positions[:, None, :].expand(b, g, s).reshape(b, 1, g * s, 1)
    row_pos = F.pad(row_pos, (0, 0, 0, R - rows), value=0)           # padded rows attend slot 0 only
    limit = row_pos if kv_len is None else torch.minimum(row_pos, kv_len.view(b, 1, 1, 1) - 1)
    kh = k.permute(0, 2, 1, 3)                                       # [b, hkv, L, d]
    vh = v.permute(0, 2, 1, 3)
    pad_keys = (-L) % KEY_BLOCK
    if pad_keys:
        kh = F.pad(kh, (0, 0, 0, pad_keys))
        vh = F.pad(vh, (0, 0, 0, pad_keys))
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    m = torch.full((b, hkv, R, 1), float("-inf"), dtype=acc_dtype, device=q.device)
    denom = torch.zeros((b, hkv, R, 1), dtype=acc_dtype, device=q.device)
    acc = torch.zeros((b, hkv, R, dv), dtype=acc_dtype, device=q.device)
    # Blocks past every row's last visible slot would be exact no-ops: skip them.
    visible_end = min(L, int(limit.max()) + 1)
    for start in range(0, visible_end, KEY_BLOCK):
        kb = kh[:, :, start:start + KEY_BLOCK]                         # [b, hkv, KB, d]
        vb = vh[:, :, start:start + KEY_BLOCK]
        scores = torch.matmul(qh, kb.transpose(-1, -2)).to(acc_dtype) * scale   # [b, hkv, R, KB]
        slots = torch.arange(start, start + KEY_BLOCK, device=q.device)
        hidden = slots > limit
        if window is not None:
            hidden = hidden | (row_pos - slots >= window)
        scores = scores.masked_fill(hidden, float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
        alpha = torch.exp(m - m_safe)
        p = torch.exp(scores - m_safe)
        denom = denom * alpha + tree_sum(p, keepdim=True)
        acc = acc * alpha + torch.matmul(p.to(v.dtype), vb).to(acc_dtype)
        m = m_new
    if sinks is not None:  # one more "key" per head with no value: rescale to the larger max, add its mass
        sink = sinks.to(acc_dtype).view(1, hkv, g, 1, 1).expand(1, hkv, g, s, 1).reshape(1, hkv, g * s, 1)
        sink = F.pad(sink, (0, 0, 0, R - rows), value=float("-inf"))    # padded rows: no sink
        m_final = torch.maximum(m, sink)
        alpha = torch.exp(m - m_final)
        denom = denom * alpha + torch.exp(sink - m_final)
        acc = acc * alpha
    out = (acc / denom)[:, :, :rows]                                 # [b, hkv, g*s, dv]
    return out.reshape(b, hkv, g, s, dv).reshape(b, hq, s, dv).permute(0, 2, 1, 3).to(q.dtype)

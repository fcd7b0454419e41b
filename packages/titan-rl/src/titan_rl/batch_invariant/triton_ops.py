"""Batch-invariant ops as Triton kernels (GPU), with fixed tiles and a fixed reduction order.

Why these are batch-invariant: every output element is produced by one program whose reduction
loop has a fixed tile size and a fixed start, whatever the number of rows:
- matmul: one program per [BLOCK_M, BLOCK_N] output tile and K chunk walks the chunk in BLOCK_K steps;
  the plan (tiles, chunks: tiles.matmul_plan) follows the weight's shape and the dtype, never the number
  of rows, and a split's partial sums are added in chunk order (no autotuning, no atomics);
- rms_norm / log_softmax: one program per row, reducing the row in fixed BLOCK-sized chunks;
- attention: one program per (batch, kv head, BLOCK_M rows of (query, query head of the group) pairs)
  walks the keys in BLOCK_N blocks from slot 0 with an online softmax; blocks past a row's position are masked to exact zeros, which
  leave the running statistics bitwise unchanged.

Backward passes use torch on the saved inputs (they need not be batch-invariant: only the forward
logprobs are compared with a generator).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_rl.batch_invariant.tiles import attention_plan, matmul_plan
from titan_rl.batch_invariant.torch_ops import eager_sink_grad, sdpa_attention_grad
from titan_models.kernels.triton_interpreter import backport_scalar_index

backport_scalar_index()  # only the CPU interpreter of triton < 3.7 needs it; compiled kernels are unaffected

MATMUL_GROUP_M = 8            # tile launch order (L2 reuse); does not change any element's reduction
SUM_BLOCK = 1024              # elements per program of the split-K sum
ROW_BLOCK = 1024            # chunk of a row for rms_norm / log_softmax


def _precision(dtype: torch.dtype) -> str | None:
    # float32 inputs would otherwise run the dot in TF32; "ieee" keeps float32 products exact.
    # For 16-bit inputs the option does not apply (None = Triton's default).
    return "ieee" if dtype == torch.float32 else None


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, K_CHUNK, stride_am, stride_ak, stride_bn, stride_bk, stride_cs,
                   stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    # program_id(1): the split; it sums K in [split * K_CHUNK, min(K, (split + 1) * K_CHUNK)) into slice
    # `split` of c (stride_cs; one split and stride 0 when K is not split)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size)
    pid_n = (pid % (GROUP_M * grid_n)) // group_size
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = split * K_CHUNK
    k_hi = tl.minimum(K, k_lo + K_CHUNK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # chunks are multiples of BLOCK_K: only K's tail is masked
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rn[None, :] * stride_bn + kk[:, None] * stride_bk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(c_ptr + split * stride_cs + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _sum_splits_kernel(p_ptr, out_ptr, numel, stride_s, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    # partials [SPLITS, numel] (slice stride stride_s) -> out [numel], added in split order: the same
    # order for every element
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(p_ptr + s * stride_s + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _matmul_fwd(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    M, K = x2d.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x2d.dtype, device=x2d.device)
    if M == 0:
        return out
    plan = matmul_plan(N, K, x2d.dtype)
    rows = plan.rows_per_launch(M, N)
    partials = None if plan.splits == 1 else torch.empty(plan.splits, rows, N, dtype=torch.float32,
                                                         device=x2d.device)
    for r0 in range(0, M, rows):  # row chunks bound the workspace; no element's arithmetic depends on them
        a, m = x2d[r0:r0 + rows], min(rows, M - r0)
        c = out[r0:r0 + m] if partials is None else partials[:, :m]
        _matmul_kernel[plan.grid(m, N)](
            a, weight, c, m, N, K, plan.k_chunk, a.stride(0), a.stride(1), weight.stride(0), weight.stride(1),
            0 if partials is None else c.stride(0), c.stride(-2), c.stride(-1), BLOCK_M=plan.block_m,
            BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, GROUP_M=MATMUL_GROUP_M, PRECISION=_precision(x2d.dtype),
            num_warps=plan.num_warps, num_stages=plan.num_stages)
        if partials is not None:
            numel = m * N
            _sum_splits_kernel[(triton.cdiv(numel, SUM_BLOCK),)](c, out[r0:r0 + m], numel, c.stride(0),
                                                                  SPLITS=plan.splits,
                                                                  BLOCK=SUM_BLOCK, num_warps=4)
    return out


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight):
        ctx.save_for_backward(x2d, weight)
        return _matmul_fwd(x2d, weight)

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x2d


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N]."""
    lead = x.shape[:-1]
    out = _Matmul.apply(x.reshape(-1, x.shape[-1]), weight.to(x.dtype))
    return out.reshape(*lead, weight.shape[0])


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, D, BLOCK):
        x = tl.load(x_ptr + row * stride_x + c0 + cols, mask=c0 + cols < D, other=0.0).to(tl.float32)
        acc += x * x
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / D + eps)
    for c0 in range(0, D, BLOCK):
        m = c0 + cols < D
        x = tl.load(x_ptr + row * stride_x + c0 + cols, mask=m, other=0.0)
        w = tl.load(w_ptr + c0 + cols, mask=m, other=0.0)
        normed = (x.to(tl.float32) * inv).to(x.dtype)  # cast back before the weight, as titan-models does
        tl.store(out_ptr + row * stride_out + c0 + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=m)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps):
        out = torch.empty(x2d.shape, dtype=torch.promote_types(x2d.dtype, weight.dtype), device=x2d.device)
        _rms_norm_kernel[(x2d.shape[0],)](x2d, weight, out, x2d.shape[1], x2d.stride(0), out.stride(0), eps,
                                          BLOCK=ROW_BLOCK, num_warps=4)
        ctx.save_for_backward(x2d, weight)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        with torch.enable_grad():
            x, w = x2d.detach().requires_grad_(), weight.detach().requires_grad_()
            xf = x.float()
            ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)).to(x.dtype)
            gx, gw = torch.autograd.grad(ref, (x, w), grad)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    lead = x.shape[:-1]
    return _RMSNorm.apply(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).reshape(*lead, x.shape[-1])


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, V, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, V, BLOCK):  # per-lane online max/sum: fixed order for a given V
        x = tl.load(x_ptr + row * stride_x + c0 + cols, mask=c0 + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - row_max), axis=0)
    lse = row_max + tl.log(total)
    for c0 in range(0, V, BLOCK):
        msk = c0 + cols < V
        x = tl.load(x_ptr + row * stride_x + c0 + cols, mask=msk, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + c0 + cols, x - lse, mask=msk)


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d):
        out = torch.empty(x2d.shape, dtype=torch.float32, device=x2d.device)
        _log_softmax_kernel[(x2d.shape[0],)](x2d, out, x2d.shape[1], x2d.stride(0), out.stride(0),
                                             BLOCK=ROW_BLOCK, num_warps=4)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad - out.exp() * grad.sum(-1, keepdim=True)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Over the last dim; float32 out."""
    lead = x.shape[:-1]
    return _LogSoftmax.apply(x.reshape(-1, x.shape[-1]).contiguous()).reshape(*lead, x.shape[-1])


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, kvlen_ptr, sink_ptr, S, L, HKV, G, scale, window,
                      sqb, sqs, sqh, skb, skl, skh, svb, svl, svh, sob, sos, soh, spb,
                      D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr):
    # D_PAD / DV_PAD: the head widths rounded up to powers of two (tl.arange's); the extra columns load zeros
    # (MLA's q/k width is not one: DeepSeek-V3 debug 48), which add nothing to the dot products.
    # Row r of a (batch, kv head) problem is query r // G of head hk * G + r % G: the G query heads that
    # share the kv head share the tile (a decode step's one query per sequence fills G rows, not one).
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    hk = bh % HKV
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // G
    h = hk * G + rows % G
    dcol = tl.arange(0, D_PAD)
    vcol = tl.arange(0, DV_PAD)
    d_ok, v_ok = dcol < D, vcol < DV
    row_ok = qi < S
    q = tl.load(q_ptr + b * sqb + qi[:, None] * sqs + h[:, None] * sqh + dcol[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos = tl.load(pos_ptr + b * spb + qi, mask=row_ok, other=0)
    limit = tl.minimum(pos, tl.load(kvlen_ptr + b) - 1)  # slot j is visible iff j <= limit
    hi = tl.minimum(tl.max(tl.where(row_ok, limit, 0), axis=0) + 1, L)
    # Blocks left of every row's window leave the initial state unchanged: start at the first block
    # (on the same block grid from slot 0) that some row of the tile can see.
    first = tl.min(tl.where(row_ok, pos - window + 1, L), axis=0)
    lo = tl.maximum(first, 0) // BLOCK_N * BLOCK_N
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, DV_PAD), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        in_range = slots < L
        k = tl.load(k_ptr + b * skb + slots[None, :] * skl + hk * skh + dcol[:, None],
                    mask=in_range[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_ptr + b * svb + slots[:, None] * svl + hk * svh + vcol[None, :],
                    mask=in_range[:, None] & v_ok[None, :], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * scale
        visible = (slots[None, :] <= limit[:, None]) & in_range[None, :] & (pos[:, None] - slots[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if HAS_SINKS:  # the head's sink joins the denominator: rescale to the larger max, add its mass
        sink = tl.load(sink_ptr + h, mask=row_ok, other=0.0).to(tl.float32)
        m_final = tl.maximum(m, sink)
        alpha = tl.exp(m - m_final)
        l = l * alpha + tl.exp(sink - m_final)
        acc = acc * alpha[:, None]
    out = acc / l[:, None]
    tl.store(o_ptr + b * sob + qi[:, None] * sos + h[:, None] * soh + vcol[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & v_ok[None, :])


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_positions, kv_len, scale, window=None, sinks=None):
        b, s, hq, d = q.shape
        L, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        pos = q_positions.to(torch.int32).contiguous()
        lens = (torch.full((b,), L, dtype=torch.int32, device=q.device) if kv_len is None
                else kv_len.to(torch.int32).contiguous())
        out = torch.empty(b, s, hq, dv, dtype=q.dtype, device=q.device)
        plan = attention_plan(q.dtype)
        g = hq // hkv
        grid = (triton.cdiv(s * g, plan.block_m), b * hkv)
        sink_arg = sinks.contiguous() if sinks is not None else out  # any pointer when HAS_SINKS is off
        _attention_kernel[grid](q, k, v, out, pos, lens, sink_arg, s, L, hkv, g, scale,
                                window if window is not None else 2**30,
                                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                                pos.stride(0), D=d, DV=dv, D_PAD=max(16, triton.next_power_of_2(d)),
                                DV_PAD=max(16, triton.next_power_of_2(dv)), BLOCK_M=plan.block_m,
                                BLOCK_N=plan.block_n, PRECISION=_precision(q.dtype),
                                HAS_SINKS=sinks is not None, num_warps=4)
        ctx.save_for_backward(q, k, v, q_positions, kv_len, sinks)
        ctx.scale, ctx.window = scale, window
        return out

    @staticmethod
    def backward(ctx, grad):
        # Recompute with torch's SDPA (masked, memory-efficient kernel on CUDA), or the eager sink
        # attention, and differentiate that.
        q, k, v, q_positions, kv_len, sinks = ctx.saved_tensors
        if sinks is None:
            grads = sdpa_attention_grad(q, k, v, q_positions, kv_len, ctx.scale, grad, window=ctx.window)
            return (*grads, None, None, None, None, None)
        gq, gk, gv, gsinks = eager_sink_grad(q, k, v, sinks, q_positions, kv_len, ctx.scale, ctx.window, grad)
        return gq, gk, gv, None, None, None, None, gsinks


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_positions: torch.Tensor, scale: float,
              kv_len: torch.Tensor | None = None, window: int | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as torch_ops.attention (any head widths: padded to powers of two inside the kernel)."""
    return _Attention.apply(q, k, v, q_positions, kv_len, scale, window, sinks)

"""Triton kernels of the chunked gated delta rule (one log decay per head), chunks of C = 64 tokens.

Legend, per (batch row, head) and chunk; S is the state entering the chunk [K, V] (float32):
    gc_i   cumulative log decay inside the chunk (cumsum of g)
    vis_ij j <= i and i, j in one segment;  D_ij = exp(gc_i - gc_j) on vis, else 0
    r_i    exp(gc_i) if token i still sees S (no document boundary since the chunk began), else 0
    e_j    exp(gc_last - gc_j) if j is in the last token's segment, else 0;  carry = exp(gc_last) [last sees S]
    A      strict_lower(beta_i (k_i . k_j) D_ij);  Tm = (I + A)^-1 (the UT transform of the WY form; by
           16-row diagonal blocks and a block Neumann series, on tensor cores)
    W = Tm diag(beta r) K,  U = Tm diag(beta) V,  Unew = U - W S       (the delta-rule corrections)
    O = diag(r) Q S + (vis * Q K^T * D) Unew;   S_next = carry S + (diag(e) K)^T Unew

Forward: `gates` (gc of every chunk, read by all the others), `prepare` (per chunk: Tm, W, U), `state_forward` (scan over chunks per V block: stores each
chunk's S and Unew, returns the final state), `output` (per chunk and V block). Backward (gradients
derived in gated_delta_rule.py's docstring): `output_backward` (P^T dO per chunk), `state_backward`
(reverse scan: dS leaving each chunk, dUnew, d initial state), `chunk_pairs_backward` (per chunk: dv,
dbeta, the [C, C] pair gradients and their share of dg) and `chunk_qk_backward` (per chunk and key
block: dq, dk and the rest of dg, which the caller sums over key blocks and reverse-cumsums per chunk). Buffers are [B, H, N*C, .]
float32 so their chunks need no masks; inputs q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H].
"""
from __future__ import annotations

import os

import triton
import triton.language as tl


def _tuned(kernel):
    """On a GPU, warps and pipeline stages are timed on the first call per (K, V, BV, OPS, tensor dtypes)
    and the fastest kept for the process (no kernel reads a buffer it writes, so the trial runs leave
    nothing behind); one config when interpreting. Another process may keep another config; the forward's
    only reductions outside tensor-core products (the gates' cumsum) are in `gates_kernel`, launched with
    one fixed config, so its bits should not depend on the choice (products accumulate over K in one order
    whatever the warps: expected of mma/wgmma, not shown on a GPU)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return kernel
    configs = [triton.Config({}, num_warps=warps, num_stages=stages) for warps in (4, 8) for stages in (1, 2)]
    return triton.autotune(configs, key=["K", "V", "BV", "OPS"])(kernel)


@triton.jit
def gates_kernel(g_ptr, gc_ptr, T, H, Tp, N, C: tl.constexpr, CB: tl.constexpr):
    """Grid (cdiv(N, CB), B*H): gc [B*H, Tp] float32, the cumulative log decay inside each chunk (zeros
    past T), CB chunks a program. Computed once per forward (and once per backward's recompute) instead of
    in every kernel, the scan's sequential loop included; its fixed launch config (not autotuned) keeps gc
    bitwise the same whatever configs the autotuner keeps for the other kernels."""
    nb, bh = tl.program_id(0), tl.program_id(1)
    bh = bh.to(tl.int64)
    b, h = bh // H, bh % H
    t = (nb * CB + tl.arange(0, CB))[:, None] * C + tl.arange(0, C)[None, :]
    g = tl.load(g_ptr + (b * T + t) * H + h, mask=t < T, other=0.0).to(tl.float32)
    tl.store(gc_ptr + bh * Tp + t, tl.cumsum(g, axis=1), mask=t < N * C)


@triton.jit
def _chunk_gates(gc_ptr, beta_ptr, seg_ptr, b, h, n, T, H, Tp, C: tl.constexpr, HAS_SEG: tl.constexpr):
    """gc [C], beta [C], vis [C, C], r [C], e [C], carry (scalar), D [C, C] of chunk n (legend above), gc
    read from `gates_kernel`'s buffer. Tokens past T have g = beta = 0 and the last valid token's
    segment, so they change nothing."""
    t = n * C + tl.arange(0, C)
    valid = t < T
    gc = tl.load(gc_ptr + (b * H + h) * Tp + t)
    gc_last = tl.load(gc_ptr + (b * H + h) * Tp + n * C + C - 1)
    beta = tl.load(beta_ptr + (b * T + t) * H + h, mask=valid, other=0.0).to(tl.float32)
    rows = tl.arange(0, C)[:, None]
    cols = tl.arange(0, C)[None, :]
    if HAS_SEG:
        seg = tl.load(seg_ptr + b * T + tl.minimum(t, T - 1))
        seg_in = tl.load(seg_ptr + b * T + tl.maximum(n * C - 1, 0))
        seg_last = tl.load(seg_ptr + b * T + tl.minimum(n * C + C - 1, T - 1))
        vis = (seg[:, None] == seg[None, :]) & (cols <= rows)
        sees = seg == seg_in
        in_last = seg == seg_last
        carry = tl.where(seg_last == seg_in, tl.exp(gc_last), 0.0)
    else:
        vis = cols <= rows
        sees = t >= 0
        in_last = t >= 0
        carry = tl.exp(gc_last)
    r = tl.where(sees, tl.exp(gc), 0.0)
    e = tl.where(in_last, tl.exp(tl.where(in_last, gc_last - gc, 0.0)), 0.0)
    D = tl.exp(tl.where(vis, gc[:, None] - gc[None, :], float("-inf")))  # masked before exp: no overflow
    return gc, beta, vis, r, e, carry, D


@triton.jit
def _load_rows(ptr, b, h, n, T, H, D_: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, d0):
    """Chunk n of an input [B, T, H, D_] as [C, BD] float32 (columns d0 .. d0+BD), zeros past T."""
    t = n * C + tl.arange(0, C)
    d = d0 + tl.arange(0, BD)
    mask = (t[:, None] < T) & (d[None, :] < D_)
    return tl.load(ptr + ((b * T + t[:, None]) * H + h) * D_ + d[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, x, b, h, n, T, H, D_: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, d0):
    t = n * C + tl.arange(0, C)
    d = d0 + tl.arange(0, BD)
    mask = (t[:, None] < T) & (d[None, :] < D_)
    tl.store(ptr + ((b * T + t[:, None]) * H + h) * D_ + d[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _buffer_offsets(b, h, n, H, Tp, D_: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, d0):
    """Offsets of chunk n, columns d0 .. d0+BD, in a float32 buffer [B, H, Tp, D_]."""
    t = n * C + tl.arange(0, C)
    return ((b * H + h) * Tp + t[:, None]) * D_ + d0 + tl.arange(0, BD)[None, :]


@triton.jit
def _state_offsets(bh, n, N, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, v0):
    """Offsets of a [K, BV] block of state n in a buffer [B*H, N, K, V]."""
    return ((bh * N + n) * K + tl.arange(0, K)[:, None]) * V + v0 + tl.arange(0, BV)[None, :]


@triton.jit
def _dot(a, b, OPS: tl.constexpr, PREC: tl.constexpr):
    """a @ b accumulated in float32. OPS "f32": float32 operands in PREC (tf32x3 or tf32); "bf16": operands
    rounded to bfloat16 (tensor cores at twice tf32's rate, half the registers); "bf16_emulated": the same
    rounding, then a float32 product (the interpreter, whose bf16 tl.dot is wrong)."""
    if OPS == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif OPS == "bf16_emulated":
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _doubled_inverse(X, A, s: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr):
    """From X, the inverses of the diagonal s x s blocks of I + A, those of its 2s x 2s blocks:
    [[L11, 0], [L21, L22]]^-1 = X - X E X, E = L21 in the lower-left quarter of each block."""
    rows = tl.arange(0, C)[:, None]
    cols = tl.arange(0, C)[None, :]
    E = tl.where((rows // (2 * s) == cols // (2 * s)) & ((rows // s) % 2 == 1) & ((cols // s) % 2 == 0), A, 0.0)
    return X - tl.dot(tl.dot(X, E, input_precision=PREC), X, input_precision=PREC)


@triton.jit
def _doubled_inverse_blocks(X, A, s: tl.constexpr, G: tl.constexpr, PREC: tl.constexpr):
    """`_doubled_inverse` on a batch of G x G diagonal blocks: X, A [blocks, G, G] (batched products)."""
    rows = tl.arange(0, G)[None, :, None]
    cols = tl.arange(0, G)[None, None, :]
    E = tl.where((rows // (2 * s) == cols // (2 * s)) & ((rows // s) % 2 == 1) & ((cols // s) % 2 == 0), A, 0.0)
    return X - tl.dot(tl.dot(X, E, input_precision=PREC), X, input_precision=PREC)


@triton.jit
def _unit_lower_inverse(A, C: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 of a strictly lower triangular A [C, C] (C = 64) by recursive block doubling
    (`_doubled_inverse`, from 1 x 1 blocks to 64 x 64), on tensor cores in PREC (tf32x3 for float32 inputs:
    the inverse amplifies rounding). 2 products a level: up to 16 x 16 blocks on the four diagonal blocks
    alone ([4, 16, 16] batched products: 6 of 16^3 each, where 64^3 products of mostly zeros took 6 of
    the 10), then 4 of 64 x 64 (the 15-step forward substitution took 19); every product is of actual
    sub-inverses and blocks of A, no powers of A. Extracting the blocks and placing them back adds zeros
    only, so the result is the same sums."""
    G: tl.constexpr = 16
    NB: tl.constexpr = C // G
    same = tl.arange(0, NB)[:, None, None, None] == tl.arange(0, NB)[None, None, :, None]  # [NB, 1, NB, 1]
    Ad = tl.sum(tl.where(same, tl.reshape(A, [NB, G, NB, G]), 0.0), axis=2)  # the diagonal blocks [NB, G, G]
    rows = tl.arange(0, G)[None, :, None]
    cols = tl.arange(0, G)[None, None, :]
    pairs = (rows // 2 == cols // 2) & (rows % 2 == 1) & (cols % 2 == 0)
    X = tl.where(rows == cols, 1.0, 0.0) - tl.where(pairs, Ad, 0.0)  # the 2 x 2 blocks' inverses
    X = _doubled_inverse_blocks(X, Ad, 2, G, PREC)
    X = _doubled_inverse_blocks(X, Ad, 4, G, PREC)
    X = _doubled_inverse_blocks(X, Ad, 8, G, PREC)
    X = tl.reshape(tl.where(same, tl.expand_dims(X, 2), 0.0), [C, C])  # block-diagonal [C, C]
    X = _doubled_inverse(X, A, 16, C, PREC)
    return _doubled_inverse(X, A, 32, C, PREC)


@_tuned
@triton.jit
def prepare_kernel(k_ptr, v_ptr, gc_ptr, beta_ptr, seg_ptr, tm_ptr, w_ptr, u_ptr, T, H, Tp,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, HAS_SEG: tl.constexpr,
                   PREC: tl.constexpr, OPS: tl.constexpr, INV_PREC: tl.constexpr, STORE_TM: tl.constexpr):
    """Grid (chunks, B*H): Tm [C, C] (only backward reads it: STORE_TM), W [C, K], U [C, V] of one chunk,
    stored in their buffers' dtype."""
    n, bh = tl.program_id(0), tl.program_id(1)
    bh = bh.to(tl.int64)  # offsets of long sequences pass 2^31
    b, h = bh // H, bh % H
    gc, beta, vis, r, e, carry, D = _chunk_gates(gc_ptr, beta_ptr, seg_ptr, b, h, n, T, H, Tp, C, HAS_SEG)
    k = _load_rows(k_ptr, b, h, n, T, H, K, C, K, 0)
    strict = vis & (tl.arange(0, C)[None, :] < tl.arange(0, C)[:, None])
    A = tl.where(strict, beta[:, None] * _dot(k, tl.trans(k), OPS, PREC) * D, 0.0)
    tm = _unit_lower_inverse(A, C, INV_PREC)  # C = 64
    if STORE_TM:
        tl.store(tm_ptr + _buffer_offsets(b, h, n, H, Tp, C, C, C, 0), tm)
    w = _dot(tm, (beta * r)[:, None] * k, OPS, PREC)
    tl.store(w_ptr + _buffer_offsets(b, h, n, H, Tp, K, C, K, 0), w.to(w_ptr.dtype.element_ty))
    v = _load_rows(v_ptr, b, h, n, T, H, V, C, V, 0)
    u = _dot(tm, beta[:, None] * v, OPS, PREC)
    tl.store(u_ptr + _buffer_offsets(b, h, n, H, Tp, V, C, V, 0), u.to(u_ptr.dtype.element_ty))


@_tuned
@triton.jit
def state_forward_kernel(k_ptr, gc_ptr, beta_ptr, seg_ptr, w_ptr, u_ptr, init_ptr, states_ptr, unew_ptr,
                         final_ptr, T, H, Tp, N, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                         C: tl.constexpr, HAS_SEG: tl.constexpr, HAS_INIT: tl.constexpr, PREC: tl.constexpr,
                         OPS: tl.constexpr):
    """Grid (B*H, V / BV): the scan over chunks, the one sequential part, so BV is small enough to give the
    GPU's SMs a program each; stores S entering each chunk and Unew (in their buffers' dtype), then the
    final S. S stays float32 in registers; with OPS "bf16" its products take it rounded to bf16."""
    bh, vb = tl.program_id(0), tl.program_id(1)
    bh = bh.to(tl.int64)  # offsets of long sequences pass 2^31
    b, h = bh // H, bh % H
    v0 = vb * BV
    state_block = (bh * K + tl.arange(0, K)[:, None]) * V + v0 + tl.arange(0, BV)[None, :]
    if HAS_INIT:
        S = tl.load(init_ptr + state_block).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    for n in range(N):
        tl.store(states_ptr + _state_offsets(bh, n, N, K, V, BV, v0), S.to(states_ptr.dtype.element_ty))
        gc, beta, vis, r, e, carry, D = _chunk_gates(gc_ptr, beta_ptr, seg_ptr, b, h, n, T, H, Tp, C, HAS_SEG)
        w = tl.load(w_ptr + _buffer_offsets(b, h, n, H, Tp, K, C, K, 0))
        u = tl.load(u_ptr + _buffer_offsets(b, h, n, H, Tp, V, C, BV, v0)).to(tl.float32)
        unew = u - _dot(w, S, OPS, PREC)
        tl.store(unew_ptr + _buffer_offsets(b, h, n, H, Tp, V, C, BV, v0), unew.to(unew_ptr.dtype.element_ty))
        k = tl.load(k_ptr + ((b * T + n * C + tl.arange(0, C)[:, None]) * H + h) * K + tl.arange(0, K)[None, :],
                    mask=(n * C + tl.arange(0, C))[:, None] < T, other=0.0)
        S = S * carry + _dot(tl.trans(k), unew * e[:, None], OPS, PREC)  # e on [C, BV], not on [C, K]
    tl.store(final_ptr + state_block, S)


@_tuned
@triton.jit
def output_kernel(q_ptr, k_ptr, gc_ptr, beta_ptr, seg_ptr, states_ptr, unew_ptr, o_ptr, T, H, Tp, N,
                  K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, HAS_SEG: tl.constexpr,
                  PREC: tl.constexpr, OPS: tl.constexpr):
    """Grid (V / BV, chunks, B*H): O = diag(r) (Q S) + (vis * Q K^T * D) Unew (r after the product: q enters
    it unrounded). The V blocks of a chunk are neighbouring programs (as fla's), so their second read of q
    and k hits L2."""
    vb, n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bh = bh.to(tl.int64)  # offsets of long sequences pass 2^31
    b, h = bh // H, bh % H
    v0 = vb * BV
    gc, beta, vis, r, e, carry, D = _chunk_gates(gc_ptr, beta_ptr, seg_ptr, b, h, n, T, H, Tp, C, HAS_SEG)
    t = n * C + tl.arange(0, C)
    rows = ((b * T + t[:, None]) * H + h) * K + tl.arange(0, K)[None, :]
    q = tl.load(q_ptr + rows, mask=t[:, None] < T, other=0.0)
    k = tl.load(k_ptr + rows, mask=t[:, None] < T, other=0.0)
    scores = _dot(q, tl.trans(k), OPS, PREC) * D
    S = tl.load(states_ptr + _state_offsets(bh, n, N, K, V, BV, v0))
    unew = tl.load(unew_ptr + _buffer_offsets(b, h, n, H, Tp, V, C, BV, v0))
    o = r[:, None] * _dot(q, S, OPS, PREC) + _dot(scores, unew, OPS, PREC)
    _store_rows(o_ptr, o, b, h, n, T, H, V, C, BV, v0)


@_tuned
@triton.jit
def output_backward_kernel(q_ptr, k_ptr, gc_ptr, beta_ptr, seg_ptr, do_ptr, dlocal_ptr, T, H, Tp,
                           K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                           HAS_SEG: tl.constexpr, PREC: tl.constexpr):
    """Grid (V / BV, chunks, B*H; a chunk's V blocks neighbours, as output_kernel's): the share of dUnew that
    needs no state, P^T dO (P = vis * Q K^T * D), in parallel over chunks so the reverse scan does not
    compute it."""
    vb, n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bh = bh.to(tl.int64)  # offsets of long sequences pass 2^31
    b, h = bh // H, bh % H
    v0 = vb * BV
    gc, beta, vis, r, e, carry, D = _chunk_gates(gc_ptr, beta_ptr, seg_ptr, b, h, n, T, H, Tp, C, HAS_SEG)
    q = _load_rows(q_ptr, b, h, n, T, H, K, C, K, 0)
    k = _load_rows(k_ptr, b, h, n, T, H, K, C, K, 0)
    scores = tl.dot(q, tl.trans(k), input_precision=PREC) * D
    do = _load_rows(do_ptr, b, h, n, T, H, V, C, BV, v0)
    tl.store(dlocal_ptr + _buffer_offsets(b, h, n, H, Tp, V, C, BV, v0),
             tl.dot(tl.trans(scores), do, input_precision=PREC))


@_tuned
@triton.jit
def state_backward_kernel(q_ptr, k_ptr, gc_ptr, beta_ptr, seg_ptr, w_ptr, do_ptr, dfinal_ptr, dlocal_ptr,
                          dstates_ptr, dunew_ptr, dinit_ptr, T, H, Tp, N, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                          C: tl.constexpr, HAS_SEG: tl.constexpr, HAS_DFINAL: tl.constexpr, PREC: tl.constexpr):
    """Grid (B*H, V / BV): the reverse scan. dS' (gradient of the state leaving chunk n) is stored per chunk;
    dUnew = P^T dO (dlocal, from output_backward) + diag(e) K dS';
    dS = carry dS' + (diag(r) Q)^T dO - W^T dUnew."""
    bh, vb = tl.program_id(0), tl.program_id(1)
    bh = bh.to(tl.int64)  # offsets of long sequences pass 2^31
    b, h = bh // H, bh % H
    v0 = vb * BV
    state_block = (bh * K + tl.arange(0, K)[:, None]) * V + v0 + tl.arange(0, BV)[None, :]
    if HAS_DFINAL:
        dS = tl.load(dfinal_ptr + state_block).to(tl.float32)
    else:
        dS = tl.zeros([K, BV], dtype=tl.float32)
    for step in range(N):
        n = N - 1 - step
        tl.store(dstates_ptr + _state_offsets(bh, n, N, K, V, BV, v0), dS)
        gc, beta, vis, r, e, carry, D = _chunk_gates(gc_ptr, beta_ptr, seg_ptr, b, h, n, T, H, Tp, C, HAS_SEG)
        k = _load_rows(k_ptr, b, h, n, T, H, K, C, K, 0)
        chunk = _buffer_offsets(b, h, n, H, Tp, V, C, BV, v0)
        # P^T dO from output_backward, in its own buffer: the autotuner runs this kernel several times
        dunew = tl.load(dlocal_ptr + chunk) + tl.dot(k * e[:, None], dS, input_precision=PREC)
        tl.store(dunew_ptr + chunk, dunew)
        q = _load_rows(q_ptr, b, h, n, T, H, K, C, K, 0)
        do = _load_rows(do_ptr, b, h, n, T, H, V, C, BV, v0)
        w = tl.load(w_ptr + _buffer_offsets(b, h, n, H, Tp, K, C, K, 0))
        dS = (dS * carry + tl.dot(tl.trans(q * r[:, None]), do, input_precision=PREC)
              - tl.dot(tl.trans(w), dunew, input_precision=PREC))
    tl.store(dinit_ptr + state_block, dS)


@_tuned
@triton.jit
def chunk_pairs_backward_kernel(q_ptr, k_ptr, v_ptr, gc_ptr, beta_ptr, seg_ptr, tm_ptr, unew_ptr, dunew_ptr,
                                do_ptr, dy_ptr, dpairs_ptr, dsystem_ptr, dbeta_ptr, dgc_ptr, T, H, Tp,
                                K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                                HAS_SEG: tl.constexpr, PREC: tl.constexpr):
    """Grid (chunks, B*H), one V block at a time: dY (float32; dv = diag(beta) dY), the pair gradients
    dP * D (scores) and dA * beta * D (the triangular system) [C, C] for the q/k kernel, dbeta but for
    its -rowsum(diag(r) K S * dY) share (the q/k kernel's, which holds S), and the pair terms of dgc
    (rowsum(G) - colsum(G))."""
    n, bh = tl.program_id(0), tl.program_id(1)
    bh = bh.to(tl.int64)  # offsets of long sequences pass 2^31
    b, h = bh // H, bh % H
    gc, beta, vis, r, e, carry, D = _chunk_gates(gc_ptr, beta_ptr, seg_ptr, b, h, n, T, H, Tp, C, HAS_SEG)
    tm = tl.load(tm_ptr + _buffer_offsets(b, h, n, H, Tp, C, C, C, 0))
    dscores = tl.zeros([C, C], dtype=tl.float32)  # dO Unew^T
    dsystem = tl.zeros([C, C], dtype=tl.float32)  # d(I + A) = -dY Unew^T
    dbeta = tl.zeros([C], dtype=tl.float32)
    for v0 in range(0, V, BV):
        unew = tl.load(unew_ptr + _buffer_offsets(b, h, n, H, Tp, V, C, BV, v0))
        dunew = tl.load(dunew_ptr + _buffer_offsets(b, h, n, H, Tp, V, C, BV, v0))
        do = _load_rows(do_ptr, b, h, n, T, H, V, C, BV, v0)
        dscores += tl.dot(do, tl.trans(unew), input_precision=PREC)
        dy = tl.dot(tl.trans(tm), dunew, input_precision=PREC)
        dsystem -= tl.dot(dy, tl.trans(unew), input_precision=PREC)
        dbeta += tl.sum(dy * _load_rows(v_ptr, b, h, n, T, H, V, C, BV, v0), axis=1)
        _store_rows(dy_ptr, dy, b, h, n, T, H, V, C, BV, v0)
    k = _load_rows(k_ptr, b, h, n, T, H, K, C, K, 0)
    q = _load_rows(q_ptr, b, h, n, T, H, K, C, K, 0)
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    kk = tl.dot(k, tl.trans(k), input_precision=PREC)
    strict = vis & (tl.arange(0, C)[None, :] < tl.arange(0, C)[:, None])
    dpairs = dscores * D  # gradient of Q K^T through the scores
    dA = tl.where(strict, dsystem, 0.0)
    dkk = dA * beta[:, None] * D  # gradient of K K^T through A
    dbeta += tl.sum(dA * kk * D, axis=1)
    pair = dpairs * qk + dkk * kk  # d(gc_i - gc_j) of each pair term
    tl.store(dpairs_ptr + _buffer_offsets(b, h, n, H, Tp, C, C, C, 0), dpairs)
    tl.store(dsystem_ptr + _buffer_offsets(b, h, n, H, Tp, C, C, C, 0), dkk)
    t = n * C + tl.arange(0, C)
    tl.store(dbeta_ptr + (b * T + t) * H + h, dbeta, mask=t < T)
    tl.store(dgc_ptr + (b * H + h) * Tp + t, tl.sum(pair, axis=1) - tl.sum(pair, axis=0))


@_tuned
@triton.jit
def chunk_qk_backward_kernel(q_ptr, k_ptr, gc_ptr, beta_ptr, seg_ptr, states_ptr, dstates_ptr, unew_ptr, do_ptr,
                             dy_ptr, dpairs_ptr, dsystem_ptr, dq_ptr, dk_ptr, dgc_ptr, dlast_ptr, dbeta_ptr,
                             T, H, Tp, N,
                             K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                             HAS_SEG: tl.constexpr, PREC: tl.constexpr):
    """Grid (chunks, B*H, K / BK): dq and dk of one key block, and its shares of dgc (dr * r - de * e, per
    token), of the last token's dgc (sum(de * e) + dcarry * carry) and of dbeta (-rowsum(diag(r) K S * dY)),
    which the caller sums over blocks."""
    n, bh, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bh = bh.to(tl.int64)  # offsets of long sequences pass 2^31
    b, h = bh // H, bh % H
    k0 = kb * BK
    gc, beta, vis, r, e, carry, D = _chunk_gates(gc_ptr, beta_ptr, seg_ptr, b, h, n, T, H, Tp, C, HAS_SEG)
    dq_state = tl.zeros([C, BK], dtype=tl.float32)  # dO S^T
    dk_end = tl.zeros([C, BK], dtype=tl.float32)  # Unew dS'^T
    dy_state = tl.zeros([C, BK], dtype=tl.float32)  # dY S^T
    dcarry = 0.0
    rows = ((bh * N + n) * K + k0 + tl.arange(0, BK)[:, None]) * V + tl.arange(0, BV)[None, :]
    for v0 in range(0, V, BV):
        S = tl.load(states_ptr + rows + v0)
        dS = tl.load(dstates_ptr + rows + v0)
        unew = tl.load(unew_ptr + _buffer_offsets(b, h, n, H, Tp, V, C, BV, v0))
        do = _load_rows(do_ptr, b, h, n, T, H, V, C, BV, v0)
        dy = _load_rows(dy_ptr, b, h, n, T, H, V, C, BV, v0)
        dq_state += tl.dot(do, tl.trans(S), input_precision=PREC)
        dk_end += tl.dot(unew, tl.trans(dS), input_precision=PREC)
        dy_state += tl.dot(dy, tl.trans(S), input_precision=PREC)
        dcarry += tl.sum(tl.sum(S * dS, axis=1), axis=0)
    q = _load_rows(q_ptr, b, h, n, T, H, K, C, BK, k0)
    k = _load_rows(k_ptr, b, h, n, T, H, K, C, BK, k0)
    dpairs = tl.load(dpairs_ptr + _buffer_offsets(b, h, n, H, Tp, C, C, C, 0))
    dkk = tl.load(dsystem_ptr + _buffer_offsets(b, h, n, H, Tp, C, C, C, 0))
    dx_state = beta[:, None] * dy_state  # dX S^T
    dq = r[:, None] * dq_state + tl.dot(dpairs, k, input_precision=PREC)
    dk = (-r[:, None] * dx_state + tl.dot(tl.trans(dpairs), q, input_precision=PREC) + e[:, None] * dk_end
          + tl.dot(dkk, k, input_precision=PREC) + tl.dot(tl.trans(dkk), k, input_precision=PREC))
    _store_rows(dq_ptr, dq, b, h, n, T, H, K, C, BK, k0)
    _store_rows(dk_ptr, dk, b, h, n, T, H, K, C, BK, k0)
    dr = tl.sum(q * dq_state, axis=1) - tl.sum(k * dx_state, axis=1)
    de = tl.sum(k * dk_end, axis=1)
    t = n * C + tl.arange(0, C)
    tl.store(dgc_ptr + ((kb * tl.num_programs(1) + bh) * Tp) + t, dr * r - de * e)
    tl.store(dlast_ptr + (kb * tl.num_programs(1) + bh) * N + n, tl.sum(de * e, axis=0) + dcarry * carry)
    tl.store(dbeta_ptr + ((kb * tl.num_programs(1) + bh) * Tp) + t, -tl.sum(k * dy_state, axis=1) * r)

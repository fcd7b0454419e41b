"""The weight gradient split into warp groups (Triton's warp specialization, Hopper).

Same product as weight_gemm.py's kernel on the padded layout (out[e] = P[rows of e]^T @ Q[rows of e],
`ends` the padded ends, every expert whole BLOCK_R chunks), written as plain nested loops: the tile
loop over this program's tiles, the row loop over the tile's expert. The tile loop is marked
`warp_specialize`, so the compiler gives the TMA loads to a producer warp and the products and the
tile's TMA store to consumer warp groups: the 64 KiB store of one tile overlaps the next tile's
loads and products, which the flattened kernel's single group of warps cannot do.

What the compiler needs for that (triton 3.6-3.8, sm_90): descriptors made in the kernel
(`tl.make_tensor_descriptor`; host descriptors failed to compile at 4 warps), 4 warps a group, and a
Triton allocator for the descriptors' global scratch (launch.py sets one), and one output: choosing
between two output descriptors per tile (weight_gemm.py's SPLIT) left the loop unspecialized and
spilling, so the launcher runs one launch per output. Row-major operands (any row stride) and a
contiguous output whose expert rows are whole BLOCK_K tiles only. Compiled for sm_90 by
hopper_check.py, checked against float64 under the interpreter and on an H100, where it ran 1.01-1.10x
the flattened kernel on the layer's shapes (tools/bench/moe/probe_wgrad_ws.py): the tuner's third
padded-layout candidate (configs.py). 64-row steps only on a GPU: 32 gave NaN there (triton 3.6).
"""
from __future__ import annotations

import triton
import triton.language as tl

from dist_moe.kernels.weight_gemm import _rows_of, _tile_origin


@triton.jit
def weight_gemm_specialized_kernel(
    p_ptr, q_ptr, out_ptr, ends_ptr, rows, KP, NQ, num_experts, stride_pr, stride_qr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_K: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    p_desc = tl.make_tensor_descriptor(p_ptr, shape=[rows, KP], strides=[stride_pr, 1], block_shape=[BLOCK_R, BLOCK_K])
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[rows, NQ], strides=[stride_qr, 1], block_shape=[BLOCK_R, BLOCK_N])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[num_experts * KP, NQ], strides=[NQ, 1],
                                         block_shape=[BLOCK_K, BLOCK_N])
    num_k = tl.cdiv(KP, BLOCK_K)
    num_n = tl.cdiv(NQ, BLOCK_N)
    per_expert = num_k * num_n
    for tile in tl.range(tl.program_id(0), per_expert * num_experts, tl.num_programs(0),
                         warp_specialize=WARP_SPECIALIZE):
        e = tile // per_expert
        k0, n0 = _tile_origin(tile % per_expert, num_k, num_n, GROUP_K, BLOCK_K, BLOCK_N)
        start, end = _rows_of(ends_ptr, e)
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_R):  # an empty expert runs no step: its tile is zeros
            acc = tl.dot(p_desc.load([r0, k0]).T, q_desc.load([r0, n0]), acc)
        out_desc.store([e * KP + k0, n0], acc.to(out_ptr.dtype.element_ty))

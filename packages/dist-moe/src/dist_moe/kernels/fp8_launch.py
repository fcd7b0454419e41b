"""Launchers of the fp8 grouped GEMMs (kernels/scaled_gemm.py): tile sizes, grids, scale strides.

Tiles: 128x128x128 with 8 warps (fp8 wgmma takes K in steps of 32; a 128-wide K step is one
DeepSeek block, so the blockwise kernel scales each step's product once). Not tuned on the H200
yet: tools/bench/moe/bench_fp8_grouped.py measures them. Under TRITON_INTERPRET=1 the tiles are
small (the CPU tests), with BLOCK_K dividing the 128-wide scale block so the block logic is the same.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from dist_moe.fp8_quant import BLOCK
from dist_moe.kernels.configs import interpreting
from dist_moe.kernels.interpreter_backport import backport_scalar_index
from dist_moe.kernels.launch import TileMaps
from dist_moe.kernels.fp8_quantize import quantize_tiles_kernel, tile_amax_kernel
from dist_moe.kernels.scaled_gemm import scaled_row_gemm_kernel, scaled_weight_gemm_kernel


@dataclass(frozen=True, kw_only=True)
class Fp8RowConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4


@dataclass(frozen=True, kw_only=True)
class Fp8WeightConfig:
    block_k: int = 128
    block_n: int = 128
    block_r: int = 128
    num_warps: int = 8
    num_stages: int = 3


def _row_config() -> Fp8RowConfig:
    if interpreting():
        return Fp8RowConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
    return Fp8RowConfig()


def _weight_config() -> Fp8WeightConfig:
    if interpreting():
        return Fp8WeightConfig(block_k=16, block_n=32, block_r=32, num_warps=4, num_stages=1)
    return Fp8WeightConfig()


def scaled_row_gemm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offsets: Tensor, out: Tensor, *,
                    blockwise: bool, config: Fp8RowConfig | None = None) -> None:
    """out [M, N] = dequantised A [M, K] @ B[e] [K, N] per expert group (offsets [E] int32 ends).

    Scales: rowwise a_scale [M], b_scale [E, N]; blockwise a_scale [M, K / 128], b_scale
    [E, K / 128, N / 128]; any strides."""
    config = config or _row_config()
    num_experts, k, n = b.shape
    rows = a.shape[0]
    if rows == 0 or n == 0:
        return
    assert BLOCK % config.block_k == 0 or not blockwise, "a K step must lie in one scale block"
    if interpreting():
        backport_scalar_index()
    maps = TileMaps(offsets, rows)
    max_row_tiles = maps.max_tiles(config.block_m)
    if blockwise:
        sa_strides = a_scale.stride()
        sb_strides = b_scale.stride()
    else:  # one scale along K: stride 0 over the (unused) K-block index
        sa_strides = (a_scale.stride(0), 0)
        sb_strides = (b_scale.stride(0), 0, b_scale.stride(1))
    grid = (max_row_tiles * triton.cdiv(n, config.block_n),)
    scaled_row_gemm_kernel[grid](
        a, a_scale, b, b_scale, out, maps.table(config.block_m),
        n, k, max_row_tiles,
        a.stride(0), a.stride(1), *sa_strides,
        b.stride(0), b.stride(1), b.stride(2), *sb_strides,
        out.stride(0), out.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        BLOCKWISE=blockwise, SCALE_BLOCK=BLOCK, EVEN_K=k % config.block_k == 0, EVEN_N=n % config.block_n == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def scaled_weight_gemm(p_t: Tensor, p_scale: Tensor, q_t: Tensor, q_scale: Tensor, padded_ends: Tensor,
                       out: Tensor, *, config: Fp8WeightConfig | None = None) -> None:
    """out[e] [KP, NQ] = sum over expert e's 128-row chunks c of P_c^T Q_c * p_scale[c] x q_scale[c].

    p_t [KP, P] and q_t [NQ, P] float8 (rows contiguous), p_scale [P / 128, KP] and q_scale
    [P / 128, NQ] float32 (columns contiguous), padded_ends [E] int32 (multiples of 128)."""
    config = config or _weight_config()
    num_experts, kp, nq = out.shape
    if num_experts == 0 or kp == 0 or nq == 0:
        return
    assert BLOCK % config.block_r == 0 and p_scale.stride(1) == 1 and q_scale.stride(1) == 1
    if interpreting():
        backport_scalar_index()
    grid = (triton.cdiv(kp, config.block_k) * triton.cdiv(nq, config.block_n), num_experts)
    scaled_weight_gemm_kernel[grid](
        p_t, p_scale, q_t, q_scale, out, padded_ends,
        kp, nq,
        p_t.stride(0), p_t.stride(1), q_t.stride(0), q_t.stride(1), p_scale.stride(0), q_scale.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_K=config.block_k, BLOCK_N=config.block_n, BLOCK_R=config.block_r, SCALE_BLOCK=BLOCK,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def fp8_supported(device: torch.device) -> bool:
    """fp8 tensor cores: sm_89 (Ada) and sm_90 (Hopper) or newer; the interpreter emulates them."""
    if interpreting() or device.type != "cuda":
        return interpreting()
    return torch.cuda.get_device_capability(device) >= (8, 9)


# Memory-bound tiles of the quantiser (not tuned on the H200 yet): 64 x 64 where a block spans the
# tile, 16 rows (or columns) per program where each row (column) is its own block.
_QUANT_TILE, _QUANT_THIN = 64, 16
# e4m3: 3 mantissa bits, smallest normal 2^-6; e5m2: 2 bits, 2^-14 (the interpreter's rounding fix)
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
_MIN_EXPONENT = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}


def _as_3d(t: Tensor) -> Tensor:
    return t.unsqueeze(0) if t.dim() == 2 else t


def block_amax_triton(t: Tensor, block_rows: int, block_cols: int) -> Tensor:
    """fp8_quant.block_amax on the GPU: tile amax (one pass over t), then torch over the small partials."""
    t3 = _as_3d(t)
    batch, rows, cols = t3.shape
    if t3.numel() == 0:
        return torch.zeros(*t.shape[:-2], rows // block_rows, cols // block_cols, device=t.device)
    reduce_r, reduce_c = block_rows > 1, block_cols > 1
    tile_r = _QUANT_TILE if reduce_r else _QUANT_THIN
    tile_c = _QUANT_TILE if reduce_c else _QUANT_THIN
    parts_r, parts_c = triton.cdiv(rows, tile_r), triton.cdiv(cols, tile_c)
    partial = torch.empty(batch, parts_r if reduce_r else rows, parts_c if reduce_c else cols,
                          device=t.device, dtype=torch.float32)
    if interpreting():
        backport_scalar_index()
    tile_amax_kernel[(parts_r, parts_c, batch)](
            t3, partial, rows, cols, *t3.stride(), *partial.stride(),
            TILE_R=tile_r, TILE_C=tile_c, REDUCE_R=reduce_r, REDUCE_C=reduce_c, num_warps=4)
    # partial tiles -> whole blocks: a block is block / tile partials (or all of them for a full axis)
    if reduce_r:
        per = partial.shape[1] if block_rows == rows else block_rows // tile_r
        partial = partial.reshape(batch, -1, per, partial.shape[2]).amax(dim=2)
    if reduce_c:
        per = partial.shape[2] if block_cols == cols else block_cols // tile_c
        partial = partial.reshape(batch, partial.shape[1], -1, per).amax(dim=3)
    return partial.reshape(*t.shape[:-2], rows // block_rows, cols // block_cols)


def quantize_with_scale_triton(t: Tensor, scale: Tensor, block_rows: int, block_cols: int, dtype: torch.dtype,
                               rows_contiguous: bool) -> Tensor:
    """fp8_quant.quantize_with_scale on the GPU (one pass over t, bit-identical to the torch ops)."""
    t3, s3 = _as_3d(t), _as_3d(scale)
    batch, rows, cols = t3.shape
    if rows_contiguous:
        q3 = torch.empty(batch, cols, rows, device=t.device, dtype=dtype).transpose(1, 2)
    else:
        q3 = torch.empty(batch, rows, cols, device=t.device, dtype=dtype)
    if t3.numel():
        if interpreting():
            backport_scalar_index()
        grid = (triton.cdiv(rows, _QUANT_TILE), triton.cdiv(cols, _QUANT_TILE), batch)
        quantize_tiles_kernel[grid](
            t3, s3, q3, rows, cols, block_rows, block_cols, *t3.stride(), *s3.stride(), *q3.stride(),
            FP8_MAX=float(torch.finfo(dtype).max), MANTISSA_BITS=_MANTISSA_BITS[dtype],
            MIN_EXPONENT=_MIN_EXPONENT[dtype], ROUND_FIRST=interpreting(),
            TILE_R=_QUANT_TILE, TILE_C=_QUANT_TILE, num_warps=4)
    return q3.reshape(t.shape) if t.dim() == 3 else q3[0]

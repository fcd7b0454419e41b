"""SwiGLU backward over routed rows (Triton): one pass from dh to the three operands of the next GEMMs.

    dh = dOut[token] @ W2^T          (a plain row-tiled GEMM, row r of the expert order)
    d weight[slot] = <dh, h>         (row sums; the routing weight w = weight[slot])
    hw    = w * h                    (the down projection's weight-gradient operand)
    d up  = w * dh * silu(gate)
    d gate = w * dh * up * silu'(gate)

A program takes one row tile of the tile table (BLOCK_M = the padded layout's chunk, so the zero
rows of an expert's last chunk lie in its last tile) and walks the columns, so each row's routing
weight gradient is summed by one program in a fixed order (deterministic, no partial buffer).
dh, gate, up and h are read at row r; the three outputs are written at row r + shift of the
padded layout, zeros in the padding rows (their loads are masked to zero).

Doing this outside the GEMM lets dh come from the fastest GEMM configuration (persistent, TMA,
128x256 tiles), which an epilogue reading three tiles and writing three cannot use (registers).
"""
from __future__ import annotations

import triton
import triton.language as tl

from dist_moe.kernels.row_tiles import tile_rows


@triton.jit
def swiglu_backward_kernel(dh_ptr, gate_ptr, up_ptr, h_ptr, dgate_ptr, dup_ptr, hw_ptr,
                           weight_ptr, dweight_ptr, tile_info_ptr, slot_ptr, max_tiles, num_cols,
                           stride_dh, stride_in, stride_out,
                           HAS_WEIGHT: tl.constexpr, WANT_DWEIGHT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    tile = tl.program_id(0)
    if tile < tl.load(tile_info_ptr + max_tiles * 5):
        m0, row_end, shift, fill_end = tile_rows(tile_info_ptr, tile)
        offs_m = tl.arange(0, BLOCK_M)
        rows = m0 + offs_m
        row_ok = rows < row_end
        row_kept = rows < fill_end
        # Scalar 64-bit tile starts, 32-bit offsets inside the tile (the launcher checks they fit):
        # fewer registers per element than 64-bit offsets for each of the seven pointers.
        dh_tile = dh_ptr + m0.to(tl.int64) * stride_dh
        gate_tile = gate_ptr + m0.to(tl.int64) * stride_in
        up_tile = up_ptr + m0.to(tl.int64) * stride_in
        h_tile = h_ptr + m0.to(tl.int64) * stride_in
        out_start = (m0 + shift).to(tl.int64) * stride_out
        dgate_tile, dup_tile, hw_tile = dgate_ptr + out_start, dup_ptr + out_start, hw_ptr + out_start
        if HAS_WEIGHT:
            slot = tl.load(slot_ptr + rows, mask=row_ok, other=0)
            w = tl.load(weight_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            dweight = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for c0 in range(0, num_cols, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            col_ok = cols < num_cols
            mask = row_ok[:, None] & col_ok[None, :]
            out_mask = row_kept[:, None] & col_ok[None, :]
            dh_offsets = offs_m[:, None] * stride_dh + cols[None, :]
            in_offsets = offs_m[:, None] * stride_in + cols[None, :]
            out_offsets = offs_m[:, None] * stride_out + cols[None, :]
            dh = tl.load(dh_tile + dh_offsets, mask=mask, other=0.0).to(tl.float32)
            h = tl.load(h_tile + in_offsets, mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                if WANT_DWEIGHT:
                    dweight += tl.sum(dh * h, axis=1)
                dh = dh * w
                h = h * w
            tl.store(hw_tile + out_offsets, h.to(hw_ptr.dtype.element_ty), mask=out_mask)
            gate = tl.load(gate_tile + in_offsets, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(up_tile + in_offsets, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            tl.store(dup_tile + out_offsets, (dh * gate * sig).to(dup_ptr.dtype.element_ty), mask=out_mask)
            dgate = dh * up * sig * (1.0 + gate * (1.0 - sig))
            tl.store(dgate_tile + out_offsets, dgate.to(dgate_ptr.dtype.element_ty), mask=out_mask)
        if WANT_DWEIGHT:
            tl.store(dweight_ptr + slot, dweight, mask=row_ok)

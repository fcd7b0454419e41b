"""The Triton kernel of swiglu.py (imported only when it runs)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def swiglu_backward_kernel(gu_ptr, dh_ptr, out_ptr, rows, width, gu_row_stride, dh_row_stride, out_row_stride,
                           BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    # gu [rows, 2 * width] = [gate | up], dh [rows, width] -> out [rows, 2 * width] = [dgate | dup]
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[None, :]
    mask = (row < rows) & (col < width)
    row = row.to(tl.int64)
    gate = tl.load(gu_ptr + row * gu_row_stride + col, mask=mask).to(tl.float32)
    up = tl.load(gu_ptr + row * gu_row_stride + width + col, mask=mask).to(tl.float32)
    dh = tl.load(dh_ptr + row * dh_row_stride + col, mask=mask).to(tl.float32)
    s = tl.sigmoid(gate)
    dup = dh * gate * s
    dgate = dh * up * s * (1.0 + gate * (1.0 - s))
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * out_row_stride + col, dgate.to(out_dtype), mask=mask)
    tl.store(out_ptr + row * out_row_stride + width + col, dup.to(out_dtype), mask=mask)

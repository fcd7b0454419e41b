"""The combine of routed rows back to their input rows (Triton, memory-bound).

    out[t] = sum_j weight[t * top_k + j] * y[pos[t * top_k + j]]      (summed in float32, j in order)

y [R, C] holds the routed rows in expert order, as a GEMM wrote them (contiguous stores, cheaper
for the GEMM than scattering rows to their slots); pos [R] int32 is the inverse of the expert
sort: pos[slot] is the routed row of that slot (`invert_slots_kernel` makes it from `row_slot` on
the device). Each program sums TOP_K rows of BLOCK_T input rows over BLOCK_C columns; the TOP_K
loads are unrolled so they are in flight together. The order of the sum is fixed, so the result
is deterministic.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def invert_slots_kernel(slot_ptr, pos_ptr, num_slots, BLOCK: tl.constexpr):
    """pos[slot[r]] = r for the R routed rows (slot is a permutation of [0, R))."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < num_slots
    slot = tl.load(slot_ptr + rows, mask=ok, other=0)
    tl.store(pos_ptr + slot, rows, mask=ok)


@triton.jit
def slot_sum_kernel(y_ptr, pos_ptr, weight_ptr, out_ptr, num_rows, num_cols, stride_y, stride_out,
                    TOP_K: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < num_cols)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = rows * TOP_K + j
        routed = tl.load(pos_ptr + slot, mask=row_ok, other=0)
        values = tl.load(y_ptr + routed.to(tl.int64)[:, None] * stride_y + cols[None, :], mask=mask,
                         other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            values *= tl.load(weight_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        acc += values
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)

"""The Triton kernel of cross_entropy.py (imported only when it runs)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cross_entropy_kernel(logits_ptr, target_ptr, valid_ptr, loss_ptr, row_stride,
                         VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row: logits [rows, VOCAB] -> loss [rows] (fp32); the row is overwritten by its gradient.
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    offsets = tl.arange(0, BLOCK)
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, VOCAB, BLOCK):
        cols = start + offsets
        x = tl.load(base + cols, mask=cols < VOCAB, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target = tl.load(target_ptr + row)
    weight = tl.load(valid_ptr + row)  # 1.0 scored, 0.0 ignored
    picked = tl.load(base + target).to(tl.float32)
    tl.store(loss_ptr + row, (lse - picked) * weight)
    out_dtype = logits_ptr.dtype.element_ty
    for start in range(0, VOCAB, BLOCK):
        cols = start + offsets
        mask = cols < VOCAB
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(cols == target, p - 1.0, p) * weight
        tl.store(base + cols, p.to(out_dtype), mask=mask)

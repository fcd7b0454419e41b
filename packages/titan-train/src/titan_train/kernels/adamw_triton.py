"""The Triton kernel of adamw.py (imported only when it runs)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def adamw_master_kernel(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, numel,
                        decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt,
                        BLOCK: tl.constexpr):
    # One AdamW step on fp32 master weights and fp32 or bf16 moments (updated in fp32, stored rounded to
    # nearest even); the parameter gets the master's rounding.
    # The scalars come computed in double on the host, as torch computes them; sqrt and division are
    # IEEE-rounded, as torch's are.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    master = tl.load(master_ptr + offsets, mask=mask)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)
    master = master * decay
    exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * (grad * grad)
    denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
    master = master - step_size * tl.div_rn(exp_avg, denom)
    tl.store(master_ptr + offsets, master, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg.to(exp_avg_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=mask)
    tl.store(param_ptr + offsets, master.to(param_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

"""One AdamW step on fp32 master weights whose parameter is a low-precision (bf16) copy.

    master = master * (1 - lr * wd)
    m      = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g^2
    master = master - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    param  = round(master)

torch.optim.AdamW's update, with g read in the parameter's dtype and every product in fp32. The Triton
kernel (CUDA) does it in one pass: 14 bytes read and 14 written per parameter for bf16.

The moments m and v may be bf16 (optimizer.moment_dtype): they are then read into fp32, updated in fp32
and rounded to nearest (even) on the way back, as torch's AdamW does for bf16 parameters' moments; the
master stays fp32. That is 4 bytes a parameter less (10 read and 10 written per step).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

_BLOCK, _WARPS = 1024, 4  # the H200 sweep of tools/bench/train_throughput/kernels.py (99% of the floor)


def adamw_master_step(param: Tensor, grad: Tensor, master: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *,
                      step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                      use_triton: bool | None = None, block: int = _BLOCK, num_warps: int = _WARPS) -> None:
    """Update master (fp32), exp_avg, exp_avg_sq (fp32 or bf16, one dtype; all contiguous) and param
    (= master rounded) in place. use_triton=None: the Triton kernel on CUDA tensors, torch ops elsewhere."""
    assert master.dtype == torch.float32 and exp_avg.dtype == exp_avg_sq.dtype, "fp32 master, one moment dtype"
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    if use_triton is None:
        use_triton = param.is_cuda
    if not use_triton:
        low_precision = exp_avg.dtype != torch.float32  # bf16 moments: the update in fp32 copies of them
        m, v = (exp_avg.float(), exp_avg_sq.float()) if low_precision else (exp_avg, exp_avg_sq)
        g = grad.to(torch.float32)
        master.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        master.addcdiv_(m, (v.sqrt() / bias_correction2_sqrt).add_(eps), value=-step_size)
        param.copy_(master)
        if low_precision:
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)
        return
    import triton

    from titan_train.kernels.adamw_triton import adamw_master_kernel

    grad = grad.contiguous()
    assert all(t.is_contiguous() for t in (param, master, exp_avg, exp_avg_sq)), "the optimizer keeps them contiguous"
    numel = param.numel()
    adamw_master_kernel[(triton.cdiv(numel, block),)](
        param, grad, master, exp_avg, exp_avg_sq, numel, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps,
        step_size, bias_correction2_sqrt, BLOCK=block, num_warps=num_warps)

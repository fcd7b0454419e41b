"""The fused loss's forward peak against its design, with the allocations of every op on the way (issue 23).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/train_throughput/loss_peak.py

Design (bf16 on CUDA, the Triton chunk kernel): one fp32 [V, d] weight gradient, summed in place over the
chunks, plus one chunk's [C, V] logits (the gradient is written over them), plus the [N, d] hidden
gradient; test_loss.py's GPU test allows half a weight gradient of slack on top. The run is made twice:
cold (the first GEMMs of the process allocate cuBLAS's workspace, 32 MiB on Hopper, through the caching
allocator, so it counts in memory_allocated) and warm (the measurement the test makes). Each op that
raises the peak is listed with what it allocated; "in-place out_dtype addmm" says whether the fp32
accumulation ran as torch.addmm(..., out_dtype=fp32, out=acc) or fell back to a bf16 product added in.
Without CUDA it runs the fp32 eager path on CPU and reports only the profiler's total peak.
"""
from __future__ import annotations

import argparse

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import titan_train.loss as loss_module
from titan_train.data import IGNORE_INDEX
from titan_train.loss import fused_linear_cross_entropy

MB = 1e6


class _PeakPerOp(TorchDispatchMode):
    """Records, for each CUDA op, the allocated bytes before it and the peak while it ran (over a base)."""

    def __init__(self, base: int):
        super().__init__()
        self.base, self.rows, self.peak = base, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        op_peak = torch.cuda.max_memory_allocated() - self.base
        if op_peak > self.peak:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            shapes = [f"{list(t.shape)} {str(t.dtype)[6:]}" for t in outs if isinstance(t, torch.Tensor)]
            self.rows.append((str(func), (before - self.base) / MB, op_peak / MB, ", ".join(shapes)))
            self.peak = op_peak
        return out


def _inputs(args, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(args.tokens, args.dim, generator=g)
    weight = torch.randn(args.vocab, args.dim, generator=g) * 0.05
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    labels[:100] = IGNORE_INDEX
    h = hidden.to(device, dtype).requires_grad_()
    w = weight.to(device, dtype).requires_grad_()
    return h, w, labels.to(device)


def _cuda_run(args, label: str) -> float:
    h, w, labels = _inputs(args, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with _PeakPerOp(base) as mode:
        fused_linear_cross_entropy(h, w, labels, chunk=args.chunk, triton=True)
    print(f"\n{label}: peak {mode.peak / MB:.1f} MB over the inputs; ops that raised it "
          f"(allocated before the op, peak during it, its outputs):")
    for name, before, peak, shapes in mode.rows:
        print(f"  {name:<34}{before:9.1f}{peak:9.1f}  {shapes}")
    return mode.peak / MB


def _cpu_run(args) -> float:
    from torch.profiler import ProfilerActivity, profile

    h, w, labels = _inputs(args, "cpu", torch.float32)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fused_linear_cross_entropy(h, w, labels, chunk=args.chunk)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak / MB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk", type=int, default=512)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    elem = 2 if cuda else 4
    grad_w, logits, grad_h = args.vocab * args.dim * 4, args.chunk * args.vocab * elem, args.tokens * args.dim * elem
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'CPU (fp32 eager path)'}")
    print(f"design: fp32 weight gradient {grad_w / MB:.1f} + one chunk's logits {logits / MB:.1f} + hidden "
          f"gradient {grad_h / MB:.1f} = {(grad_w + logits + grad_h) / MB:.1f} MB"
          + (f"; the GPU test's bound {(grad_w + logits + grad_w // 2) / MB:.1f} MB" if cuda else ""))
    if not cuda:  # the eager chunk's logsumexp makes one [C, V] temporary more
        print(f"CPU peak {_cpu_run(args):.1f} MB (design + the logsumexp temporary: "
              f"{(grad_w + 2 * logits + grad_h) / MB:.1f} MB)")
        return
    _cuda_run(args, "cold (first GEMMs of the process)")
    _cuda_run(args, "warm (cuBLAS workspace already allocated)")
    print(f"\nin-place out_dtype addmm: {loss_module._out_dtype_products}")


if __name__ == "__main__":
    main()

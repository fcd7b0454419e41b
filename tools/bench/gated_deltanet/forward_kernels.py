"""Per-kernel GPU time of one forward (no autograd graph) or forward + backward, for `bench_delta_rule.py
--forward-kernels` / `--train-kernels`: each implementation's step runs `warmup` times (autotuning
included), then `repeats` times under torch.profiler; every CUDA kernel is listed with its launches per
step and its mean time per step, largest first, with the kernels' sum (the step's device time, without
the host gaps between launches).
"""
from __future__ import annotations

from collections import defaultdict

import torch


def kernel_times(fn, tensors, *, warmup: int, repeats: int, backward: bool = False
                 ) -> list[tuple[str, float, float]]:
    """[(kernel name, launches per step, ms per step)] of fn(*tensors), largest time first; a step is one
    forward, or with `backward` one forward and backward of the bench's loss (out.float().square().mean())."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    tensors = [t.detach().requires_grad_(backward) for t in tensors]

    def step():
        with torch.set_grad_enabled(backward):
            out = fn(*tensors)
            if backward:
                out.float().square().mean().backward()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    launches, micros = defaultdict(int), defaultdict(float)
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        launches[event.name] += 1
        micros[event.name] += event.time_range.elapsed_us()  # a kernel's own span on the device
    rows = [(name, launches[name] / repeats, micros[name] / repeats / 1e3) for name in micros]
    return sorted(rows, key=lambda row: -row[2])


def print_kernel_times(name: str, rows: list[tuple[str, float, float]]) -> None:
    total = sum(ms for _, _, ms in rows)
    print(f"{name}: {total:.3f} ms of kernels per step", flush=True)
    for kernel, count, ms in rows:
        print(f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  x{count:<4g} {kernel[:100]}")

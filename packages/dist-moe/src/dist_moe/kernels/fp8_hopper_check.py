"""Compile the fp8 grouped-GEMM kernels for Hopper (sm_90) on a machine without a GPU, and check them.

    python -m dist_moe.kernels.fp8_hopper_check

The launches of one grouped_mm_fp8 forward+backward per recipe (rowwise and blockwise, e4m3 and
e5m2 gradients) at DeepSeek-V3-16B expert widths (hidden 2048, expert width 1408) are recorded,
not run, then compiled ahead of time with the checks of hopper_check: wgmma (fp8 operands),
a pipelined main loop, shared memory within 227 KiB, at most 64 bytes of register spills; and
the quantisation kernels (memory-bound: compiled, shared memory and spills checked).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from dist_moe.kernels import hopper_check


@contextmanager
def _hopper_configs_recorded(seen: list):
    """Record the fp8 launches (and the tile table's) with the Hopper tile sizes, on CPU tensors."""
    import dist_moe.kernels.fp8_launch as fp8_launch
    import dist_moe.kernels.launch as launch

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((self.kernel, args, kwargs))

    saved = {(fp8_launch, n): getattr(fp8_launch, n) for n in
             ("scaled_row_gemm_kernel", "scaled_weight_gemm_kernel", "tile_amax_kernel", "quantize_tiles_kernel",
              "_row_config", "_weight_config", "fp8_supported")}
    saved[(launch, "tile_map_kernel")] = launch.tile_map_kernel
    fp8_launch.scaled_row_gemm_kernel = Recorder(saved[(fp8_launch, "scaled_row_gemm_kernel")])
    fp8_launch.scaled_weight_gemm_kernel = Recorder(saved[(fp8_launch, "scaled_weight_gemm_kernel")])
    launch.tile_map_kernel = Recorder(saved[(launch, "tile_map_kernel")])
    for name in ("tile_amax_kernel", "quantize_tiles_kernel"):
        setattr(fp8_launch, name, Recorder(saved[(fp8_launch, name)]))
    fp8_launch._row_config, fp8_launch._weight_config = fp8_launch.Fp8RowConfig, fp8_launch.Fp8WeightConfig
    fp8_launch.fp8_supported = lambda device: True
    try:
        with hopper_check._pretend_triton_on_cpu():
            yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def fp8_launches() -> list:
    import dist_moe

    dim, ffn, experts, tokens = 2048, 1408, 4, 64
    gen = torch.Generator().manual_seed(0)
    seen: list = []
    with _hopper_configs_recorded(seen):
        for granularity in ("rowwise", "blockwise"):
            for grad_format in ("e4m3", "e5m2"):
                x = torch.randn(tokens, dim, generator=gen).bfloat16().requires_grad_()
                w = torch.randn(experts, ffn, dim, generator=gen).bfloat16().requires_grad_()  # [E, N, K]
                offsets = torch.tensor([16, 16, 50, 64], dtype=torch.int32)
                recipe = dist_moe.Fp8Recipe(granularity=granularity, grad_format=grad_format)
                out = dist_moe.grouped_mm_fp8(x, w.transpose(1, 2), offsets, recipe=recipe, backend="triton")
                out.backward(torch.randn(out.shape, generator=gen).bfloat16())
    return seen


def main() -> int:
    return hopper_check.check(fp8_launches())


if __name__ == "__main__":
    sys.exit(1 if main() else 0)

"""Compile dist-moe's Triton kernels for Hopper (sm_90) without a GPU: the layer's kernels with every
library candidate configuration (dist_moe.kernels.hopper_check) plus, with --sweep, every
configuration bench_moe.py sweeps (grouped GEMM, weight gradient, and the layer with each
in-place backward-sweep variant). Exits 1 if any variant fails to build, to pipeline, to fit
shared memory, or spills more than 64 bytes of registers per thread. Works with triton 3.6 and 3.8
(the H200 has 3.6); run it with both before a GPU run.

    uv run --frozen --no-sync python tools/bench/moe/check_hopper_compile.py [--quick] [--sweep]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from dist_moe.kernels.hopper_check import (
    _capability,
    _pretend_triton_on_cpu,
    capture_launches,
    capture_layer,
    check,
    layer_launches,
)


def sweep_launches():
    """Launches of every configuration bench_moe.py sweeps: the grouped GEMM forward, the weight
    gradient (padded TMA operands, one and two outputs; pointer loads), and the layer with one
    kernel role forced to each variant of the in-place backward sweep."""
    import dist_moe.kernels.configs as configs
    import dist_moe.kernels.launch as launch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gemm_sections import row_sweep, weight_sweep
    from layer_sections import bwd_variants

    bf = torch.bfloat16
    x, linear_w = torch.zeros(256, 7168, dtype=bf), torch.zeros(4, 2048, 7168, dtype=bf)
    offsets = torch.tensor([64, 128, 192, 256], dtype=torch.int32)
    out = torch.zeros(256, 2048, dtype=bf)
    dy = torch.zeros(256, 2048, dtype=bf)
    wide = torch.zeros(256 + 4 * 63, 6144, dtype=bf)  # [dgate | dup | w h] in the padded layout
    x_padded = torch.zeros(256 + 4 * 63, 7168, dtype=bf)
    dw = torch.zeros(4, 2048, 7168, dtype=bf)
    tma_configs, pointer_configs = weight_sweep(dry=False)
    with capture_launches(launch) as seen, _pretend_triton_on_cpu():
        for config in row_sweep(dry=False):
            launch.row_gemm(launch.RowOperands(a=x, b=linear_w.transpose(1, 2), offsets=offsets, out=out,
                                               num_rows=256), config)
        for config in tma_configs:
            launch.weight_gemm(p=wide[:, :4096], q=x_padded, ends=offsets, outs=(dw, dw.clone()), padded=True,
                               config=config)
            launch.weight_gemm(p=x_padded, q=wide[:, 4096:], ends=offsets, outs=(dw.transpose(1, 2),), padded=True,
                               config=config)
        for config in pointer_configs:
            launch.weight_gemm(p=dy, q=x, ends=offsets, outs=(dw,), config=config)
    with _capability(9, 0):  # the shipped first candidates, as an sm_90 GPU sees them
        gpu = torch.device("cuda")
        first_rows = {role: configs.row_candidates(role, gpu, bf)[0] for role in configs.ROLES}
        first_weights = {tma: configs.weight_candidates(gpu, bf, tma=tma)[0] for tma in (False, True)}
    for role, config in bwd_variants(dry=False):
        def rows(r, device, dtype=None, role=role, config=config):
            return [config if r == role else first_rows[r]]

        def weights_of(device, dtype=None, *, tma=False, role=role, config=config):
            return [config if role == "weight" and tma else first_weights[tma]]

        seen.extend(capture_layer(rows, weights_of))
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the first candidate of each kernel")
    parser.add_argument("--sweep", action="store_true", help="also every configuration the benchmark sweeps")
    args = parser.parse_args()
    launches = layer_launches(args.quick) + (sweep_launches() if args.sweep else [])
    return 1 if check(launches) else 0


if __name__ == "__main__":
    sys.exit(main())

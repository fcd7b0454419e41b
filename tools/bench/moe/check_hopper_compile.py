"""Compile dist-moe's Triton kernels for Hopper (sm_90) without a GPU: the layer's kernels with every
library candidate configuration (dist_moe.kernels.hopper_check) plus, with --sweep, every
configuration bench_moe.py sweeps. Exits 1 if any variant fails to build, to pipeline, to fit
shared memory, or spills more than 64 bytes of registers per thread.

    uv run --frozen --no-sync python tools/bench/moe/check_hopper_compile.py [--quick] [--sweep]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from dist_moe.kernels.hopper_check import _pretend_triton_on_cpu, capture_launches, check, layer_launches


def sweep_launches():
    """Launches of every configuration bench_moe.py sweeps (grouped GEMM and weight gradient)."""
    import dist_moe.kernels.launch as launch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_moe

    bf = torch.bfloat16
    x, linear_w = torch.zeros(256, 7168, dtype=bf), torch.zeros(4, 2048, 7168, dtype=bf)
    offsets = torch.tensor([64, 128, 192, 256], dtype=torch.int32)
    out = torch.zeros(256, 2048, dtype=bf)
    dy = torch.zeros(256, 2048, dtype=bf)
    with capture_launches(launch) as seen, _pretend_triton_on_cpu():
        for config in bench_moe.row_sweep(dry=False):
            launch.row_gemm(launch.RowOperands(a=x, b=linear_w.transpose(1, 2), offsets=offsets, out=out,
                                               num_rows=256), config)
        for config in bench_moe.weight_sweep(dry=False):
            launch.weight_gemm(p=x, q=dy, offsets=offsets, out=linear_w.transpose(1, 2), config=config)
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

"""Launch plans of the Triton batch-invariant kernels (plain Python: testable without a GPU or Triton).

What keeps a kernel batch-invariant is that nothing an element's arithmetic depends on (tile sizes, the
K chunks of a split, warps, stages) is chosen from the number of rows M. A plan may depend on the weight's
shape (N, K) and the dtype, which are the same in the trainer and the generator; only the grid, and how
many rows one launch takes, follow M.

Float32 (IEEE products, no TF32) runs tl.dot as FMAs on the CUDA cores. With the 16-bit tile (128 x 128,
one program walking all of K) a decode step of 64 rows got one program per 128 output columns: 16
programs on an H200's 132 SMs for a 2048-wide projection, each walking the whole K (8192 for the FFN's
down projection), so most of the GPU idled and every step took ~10x the normal mode's time. Float32
therefore uses 64 x 64 tiles and splits K into chunks chosen from (N, K): enough chunks that one 64-row
tile of output gives TARGET_PROGRAMS programs, each at least MIN_K_CHUNK long (the partials' extra memory
traffic stays small at training's large M). The chunks' partial sums are added in chunk order (0, 1, ...)
by a second kernel, the same order for every row. 16-bit dtypes keep the single-program tensor-core tile
(their decode cost was measured at 1.24x the normal mode's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Two resident programs on each of an H200's 132 SMs. A constant, not read from the device: a generator on
# another GPU model must still get the trainer's plan (and bits).
TARGET_PROGRAMS = 2 * 132
MIN_K_CHUNK = 256
WORKSPACE_ELEMENTS = 1 << 26  # float32 partials per launch (256 MiB): larger M runs in row chunks


@dataclass(frozen=True)
class MatmulPlan:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    k_chunk: int   # K per split (a multiple of block_k); K itself when unsplit
    splits: int    # cdiv(K, k_chunk)

    def rows_per_launch(self, M: int, N: int) -> int:
        """Rows of one launch: all of M unless the split's partials [splits, rows, N] would outgrow the
        workspace bound (a multiple of block_m, so the tiles do not move)."""
        if self.splits == 1:
            return max(M, 1)
        rows = max(self.block_m, WORKSPACE_ELEMENTS // (self.splits * N) // self.block_m * self.block_m)
        return min(max(M, 1), rows)

    def grid(self, M: int, N: int) -> tuple[int, int]:
        """(output tiles, splits) of a launch over M rows."""
        return (-(-M // self.block_m)) * (-(-N // self.block_n)), self.splits


def matmul_plan(N: int, K: int, dtype: torch.dtype) -> MatmulPlan:
    """The plan for x [M, K] @ weight [N, K]^T: a function of N, K and the dtype, never of M."""
    if dtype == torch.float32:
        # 64 x 64 x 32, 4 warps: 187 registers, no spills, 32 KiB shared (ptxas -v for sm_90, Triton 3.6);
        # the 16-bit tile in float32 used 255 registers and spilled.
        block_k, tiles_n = 32, -(-N // 64)
        wanted = -(-TARGET_PROGRAMS // tiles_n)
        chunk = max(MIN_K_CHUNK, -(-K // wanted))
        chunk = -(-chunk // block_k) * block_k
        return MatmulPlan(64, 64, block_k, num_warps=4, num_stages=3, k_chunk=chunk, splits=max(1, -(-K // chunk)))
    return MatmulPlan(128, 128, 64, num_warps=8, num_stages=3, k_chunk=max(K, 1), splits=1)


@dataclass(frozen=True)
class AttentionPlan:
    block_m: int   # rows of a tile: (query, head of the kv head's group) pairs
    block_n: int   # keys per block


def attention_plan(dtype: torch.dtype) -> AttentionPlan:
    """Float32 tiles of 16 rows: a decode step has one query per sequence, so a tile holds the group's
    query heads (4 for Llama-3's 32/8) and a 64-row tile computed 60 rows of padding; 16-bit dtypes keep
    64 rows (tensor-core dots)."""
    return AttentionPlan(16, 64) if dtype == torch.float32 else AttentionPlan(64, 64)

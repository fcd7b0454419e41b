"""Kernel configurations (tile sizes, warps, stages, launch style) and the first-call tuner.

Candidates are ordered best-guess first. On Hopper, tl.dot of bf16 with a float32 accumulator
becomes wgmma; 128x256x64 tiles with 8 warps and 3-4 stages fill the 227 KiB of shared memory
the way the fastest published Triton Hopper GEMMs do. With autotuning on (the default on CUDA;
DIST_MOE_AUTOTUNE=0 turns it off) the first call for a (kernel, shape, dtype) key times every
candidate once and keeps the fastest; a candidate that fails to compile is skipped.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch


@dataclass(frozen=True, kw_only=True)
class RowConfig:
    """Row-tiled kernel: tile BLOCK_M x BLOCK_N, K step BLOCK_K, GROUP_M row tiles per L2 group."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False
    flatten: bool = False  # persistent only: fuse the tile loop with the K loop (next tile's loads overlap)
    tma: bool = False  # TMA descriptors for the operands that allow them (un-gathered, aligned)

    def name(self) -> str:
        style = ("persistent" if self.persistent else "grid") + ("+flat" if self.flatten else "")
        style += "+tma" if self.tma else ""
        return (f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} w{self.num_warps} "
                f"s{self.num_stages} {style}")


@dataclass(frozen=True, kw_only=True)
class WeightConfig:
    """Weight-gradient kernel: output tile BLOCK_K x BLOCK_N, BLOCK_R rows per step."""

    block_k: int = 128
    block_n: int = 128
    block_r: int = 64
    group_k: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False
    flatten: bool = False

    def name(self) -> str:
        style = ("persistent" if self.persistent else "grid") + ("+flat" if self.flatten else "")
        return (f"{self.block_k}x{self.block_n}x{self.block_r} g{self.group_k} w{self.num_warps} "
                f"s{self.num_stages} {style}")


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on CPU tensors, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


# Row-tiled kernel roles: "plain" (grouped_mm, the down projection), "concat" (the input gradient,
# two A/B pairs in one accumulator), "dual"
# (gate and up in one tile: two accumulators, so half the N width), "swiglu_bwd" (heavier epilogue:
# narrower tiles). tools/bench/moe/check_hopper_compile.py compiles every candidate for sm_90 and
# checks pipelining, shared memory and register spills.
def row_candidates(role: str, device: torch.device) -> list[RowConfig]:
    if interpreting():
        return [RowConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)]
    if _capability(device) >= (9, 0):
        if role in ("plain", "concat"):
            candidates = [
                RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
                RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4),
                RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, tma=True),
                RowConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3),  # 2 programs per SM
            ]
            # Two A/B pairs in one loop: 4 stages spill registers (triton 3.6).
            return [c for c in candidates if role == "plain" or c.num_stages == 3]
        if role == "dual":  # two float32 accumulators: 128x128 each is the register budget
            return [
                RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
                RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4),
                RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, tma=True),
                RowConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=4),
            ]
        # swiglu_bwd: the epilogue holds the accumulator and three loaded tiles; 128x128 spills.
        return [
            RowConfig(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=4),
            RowConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=4),
            RowConfig(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=4, tma=True),
            RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
        ]
    return [
        RowConfig(block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=4),
        RowConfig(block_m=128, block_n=64, block_k=32, num_warps=4, num_stages=4),
    ]


def weight_candidates(device: torch.device, *, two_outputs: bool = False) -> list[WeightConfig]:
    """Two outputs (gate and up gradients) mean two accumulators: half the tile each."""
    if interpreting():
        return [WeightConfig(block_k=16, block_n=16, block_r=16, group_k=2, num_warps=4, num_stages=1)]
    if _capability(device) >= (9, 0):
        if two_outputs:
            return [
                WeightConfig(block_k=128, block_n=128, block_r=64, num_warps=8, num_stages=3),
                WeightConfig(block_k=128, block_n=128, block_r=64, num_warps=8, num_stages=4),
                WeightConfig(block_k=128, block_n=64, block_r=64, num_warps=4, num_stages=4),
            ]
        return [
            WeightConfig(block_k=128, block_n=256, block_r=64, num_warps=8, num_stages=3),
            WeightConfig(block_k=128, block_n=128, block_r=64, num_warps=8, num_stages=4),
            WeightConfig(block_k=256, block_n=128, block_r=64, num_warps=8, num_stages=3),
            # 96 KiB of shared memory: two programs per SM, one's epilogue hiding the other's loads.
            WeightConfig(block_k=128, block_n=128, block_r=64, num_warps=4, num_stages=3),
        ]
    return [WeightConfig(block_k=128, block_n=128, block_r=32, num_warps=4, num_stages=4)]


Config = TypeVar("Config", RowConfig, WeightConfig)
_chosen: dict[tuple, object] = {}


def autotune_enabled() -> bool:
    return os.environ.get("DIST_MOE_AUTOTUNE", "1") != "0" and not interpreting()


def choose(key: tuple, candidates: Sequence[Config], launch: Callable[[Config], None]) -> Config:
    """The fastest candidate for `key` (timed once per process), or the first when tuning is off.

    Every candidate writes the same outputs (no accumulation), so timing them in place is safe.
    """
    if key in _chosen:
        return _chosen[key]  # type: ignore[return-value]
    if len(candidates) == 1 or not autotune_enabled():
        _chosen[key] = candidates[0]
        return candidates[0]
    from triton.testing import do_bench

    best, best_ms, errors = None, float("inf"), []
    for config in candidates:
        try:
            ms = do_bench(lambda: launch(config), warmup=5, rep=20)
        except Exception as err:  # a config may not compile or fit (shared memory): try the next
            errors.append(f"{config.name()}: {type(err).__name__}: {err}")
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    if best is None:
        raise RuntimeError("no kernel configuration ran:\n" + "\n".join(errors))
    _chosen[key] = best
    return best


def chosen_configs() -> dict[tuple, object]:
    """What the tuner picked so far, per key (benchmarks print it)."""
    return dict(_chosen)

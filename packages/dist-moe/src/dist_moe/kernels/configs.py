"""Kernel configurations (tile sizes, warps, stages, launch style) and the first-call tuner.

Candidates are ordered best first (the H200 sweep of tools/bench/moe). On Hopper, tl.dot of bf16
with a float32 accumulator becomes wgmma; 128x256x64 tiles with 8 warps and 3-4 stages fill the
227 KiB of shared memory. With autotuning on (the default on CUDA; DIST_MOE_AUTOTUNE=0 turns it
off) the first call for a (kernel, shape, dtype) key times its 2-3 candidates taking turns (see
`choose`) and keeps the fastest; a candidate that fails to compile is skipped. float32 on
GPU (a correctness path) has one small tile and is never tuned.
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
    """Weight-gradient kernel: output tile BLOCK_K x BLOCK_N, BLOCK_R rows per step; persistent
    launches run `per_sm` programs per SM, otherwise one program per tile."""

    block_k: int = 128
    block_n: int = 128
    block_r: int = 64
    group_k: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False
    per_sm: int = 1
    store_tma: bool = False  # contiguous outputs whose rows are whole tiles: TMA stores
    # weight_gemm_specialized.py: Triton's warp specialization (padded operands, contiguous outputs of
    # whole tiles; persistent, TMA stores; other layouts run the flattened kernel with these tiles, 8 warps
    # for 128x256)
    warp_specialize: bool = False

    def name(self) -> str:
        style = f"persistent x{self.per_sm}" if self.persistent else "grid"
        style += " +tma store" if self.store_tma else ""
        style += " +warp-specialized" if self.warp_specialize else ""
        return (f"{self.block_k}x{self.block_n}x{self.block_r} g{self.group_k} w{self.num_warps} "
                f"s{self.num_stages} {style}")


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on CPU tensors, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def _wgmma_dtype(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


# Row-tiled kernel roles: "plain" (grouped_mm, the down projection, dOut @ W2), "dual" (gate and
# up in one tile: two accumulators, so half the N width; "dual_tma" the same on routed rows copied
# once, read through TMA), "concat" (the input gradient, two A/B
# pairs in one accumulator).
# Hopper, 16-bit: the H200 sweep's best configurations first (tools/bench/moe, float64-checked):
# grouped GEMM 128x256x64, 8 warps, 3 stages, persistent with the tile loop flattened into the K
# loop and TMA operands: the best of the sweep on every shape in three runs, timed taking turns
# (gate/up uniform / skewed, down uniform / skewed: 784-794 / 721-736 / 762-774 / 687-700 TFLOP/s
# against 769-784 / 706-724 / 726-742 / 659-674 for a tile per program; in the layer's down
# projection 1.24-1.26 ms against 1.28-1.33, tools/bench/moe/probe_combine.py).
# tools/bench/moe/check_hopper_compile.py compiles every candidate for sm_90 and checks
# pipelining, shared memory and register spills.
_HOPPER_ROWS = {
    "plain": [
        RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, persistent=True, flatten=True,
                  tma=True),
        RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, persistent=True, tma=True),
        RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, tma=True),
    ],
    # The gathered A comes through pointer loads (TMA cannot gather on Hopper); two float32
    # accumulators: 128x128 each is the register budget. A tile per program at 4 stages with
    # pointer weights first: the tuner chose it in every bench run of this session, and in the layer
    # (one role forced, H200) it ran 2.82 / 3.04 ms uniform / skewed against 2.93 / 3.20 persistent
    # at 3 stages and 2.84 / 3.45 at 4 (TMA weights). Earlier sweeps: flattened 6.04 ms (the next
    # tile's gathered loads then serialise with this tile's epilogue); 128x128x128 (3.83) and
    # 128x128x32 at 6 stages (3.23) are slower.
    "dual": [
        RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4),
        RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, persistent=True, tma=True),
        RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, persistent=True, tma=True),
    ],
    # Gate and up on the routed rows copied once (expert_mlp's keep_routed_input): A in the padded
    # layout, so every operand goes through TMA. Persistent at 4 stages first: the tuner chose it over
    # the two flattened ones in the layer on an H100 (2026-12-07; 2.56 / 2.79 ms uniform / skewed, 751 /
    # 689 TFLOP/s, against 2.82 / 3.08 ms for the "dual" role gathering inside the kernel).
    "dual_tma": [
        RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, persistent=True, tma=True),
        RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, persistent=True, flatten=True,
                  tma=True),
        RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, persistent=True, flatten=True,
                  tma=True),
    ],
    # Two K loops in one tile; 4 stages of 128x256 spill registers (triton 3.6). Persistent with
    # flatten requested first: in the layer 2.92 / 3.12 ms (uniform / skewed) against 3.02 / 3.31 for
    # a tile per program (H200).
    "concat": [
        RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, persistent=True, flatten=True,
                  tma=True),
        RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, tma=True),
        RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, persistent=True, tma=True),
    ],
}
ROLES = tuple(_HOPPER_ROWS)


def row_candidates(role: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> list[RowConfig]:
    assert role in ROLES, role
    if interpreting():  # tiny tiles
        return [RowConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)]
    if not _wgmma_dtype(dtype):  # float32 on GPU is a correctness path: one small tile, no tuning
        return [RowConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2)]
    if _capability(device) >= (9, 0):
        return list(_HOPPER_ROWS[role])
    return [
        RowConfig(block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=4),
        RowConfig(block_m=128, block_n=64, block_k=32, num_warps=4, num_stages=4),
    ]


# Weight gradient, Hopper, 16-bit, operands in the padded layout through TMA (the expert MLP's
# backward): a persistent 128x256 tile whose flattened loop prefetches the next tile during the
# store (short row loops: 1024 rows per expert are 16 steps), its result written by a TMA store,
# L2 groups of 32 or 8 K tiles. H200, on the layer's operands (w2 / w1+w3, uniform routing):
# 698 / 714 and 700 / 696 TFLOP/s, against 612 / 658 with pointer stores and 623 / 589 for 128x128
# tiles at two programs per SM (no longer shipped: the first-call tuner picked it by noise, 0.3 ms
# slower in the layer). Third, the warp-specialized kernel (weight_gemm_specialized.py: a producer warp
# group loads while the consumers multiply and store): H100, tools/bench/moe/probe_wgrad_ws.py,
# 1.01-1.10x the first candidate on the four layer shapes (2026-12-08); the layer's tuner chose it
# for every weight gradient. 4 warps a group is what Triton's specialization takes.
_HOPPER_WEIGHTS_TMA = [
    WeightConfig(block_k=128, block_n=256, block_r=64, group_k=32, num_warps=8, num_stages=3, persistent=True,
                 store_tma=True),
    WeightConfig(block_k=128, block_n=256, block_r=64, num_warps=8, num_stages=3, persistent=True, store_tma=True),
    WeightConfig(block_k=128, block_n=256, block_r=64, group_k=8, num_warps=4, num_stages=3, persistent=True,
                 store_tma=True, warp_specialize=True),
]
# Pointer loads with masked tails (grouped_mm's backward on unpadded rows): the H200 sweep's best.
_HOPPER_WEIGHTS_POINTER = [
    WeightConfig(block_k=128, block_n=128, block_r=64, num_warps=4, num_stages=3),
    WeightConfig(block_k=128, block_n=256, block_r=64, num_warps=8, num_stages=3),
]


def weight_candidates(device: torch.device, dtype: torch.dtype = torch.bfloat16, *,
                      tma: bool = False) -> list[WeightConfig]:
    if interpreting():
        return [WeightConfig(block_k=16, block_n=16, block_r=16, group_k=2, num_warps=4, num_stages=1)]
    if not _wgmma_dtype(dtype):
        return [WeightConfig(block_k=64, block_n=64, block_r=32, num_warps=4, num_stages=2)]
    if _capability(device) >= (9, 0):
        return list(_HOPPER_WEIGHTS_TMA if tma else _HOPPER_WEIGHTS_POINTER)
    return [WeightConfig(block_k=128, block_n=128, block_r=32, num_warps=4, num_stages=4)]


Config = TypeVar("Config", RowConfig, WeightConfig)
_chosen: dict[tuple, object] = {}


def autotune_enabled() -> bool:
    return os.environ.get("DIST_MOE_AUTOTUNE", "1") != "0" and not interpreting()


# Tuning: each candidate runs once (compiles, warms), then the candidates take turns in
# TUNE_ROUNDS rounds of about TUNE_BLOCK_MS of back-to-back calls each; the median block wins.
# Taking turns matters on a power-limited GPU: timed one after the other, the later candidates
# run on a hotter, slower-clocked chip and lose by a few percent they do not deserve.
TUNE_ROUNDS = 7
TUNE_BLOCK_MS = 6.0


def choose(key: tuple, candidates: Sequence[Config], launch: Callable[[Config], None]) -> Config:
    """The fastest candidate for `key` (timed once per process), or the first when tuning is off.

    Every candidate writes the same outputs (no accumulation), so timing them in place is safe.
    """
    if key in _chosen:
        return _chosen[key]  # type: ignore[return-value]
    if len(candidates) == 1 or not autotune_enabled():
        _chosen[key] = candidates[0]
        return candidates[0]
    runnable, errors = [], []
    for config in candidates:
        try:
            launch(config)
            runnable.append(config)
        except Exception as err:  # a config may not compile or fit (shared memory): try the next
            errors.append(f"{config.name()}: {type(err).__name__}: {err}")
    if not runnable:
        raise RuntimeError("no kernel configuration ran:\n" + "\n".join(errors))
    times = _alternating_ms(runnable, launch)
    best = min(range(len(runnable)), key=lambda i: times[i])
    _chosen[key] = runnable[best]
    return runnable[best]


def _alternating_ms(configs: Sequence[Config], launch: Callable[[Config], None]) -> list[float]:
    """Median milliseconds per call of each config, the configs taking turns in blocks."""
    import statistics

    def block_ms(config, calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            launch(config)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    calls = [max(1, min(50, int(TUNE_BLOCK_MS / max(block_ms(c, 1), 1e-3)))) for c in configs]
    samples: list[list[float]] = [[] for _ in configs]
    for _ in range(TUNE_ROUNDS):
        for i, config in enumerate(configs):
            samples[i].append(block_ms(config, calls[i]))
    return [statistics.median(s) for s in samples]


def chosen_configs() -> dict[tuple, object]:
    """What the tuner picked so far, per key (benchmarks print it)."""
    return dict(_chosen)

"""Launchers for the Triton kernels: argument checks, TMA descriptors, grids, tuning keys.

Nothing here reads device data on the host: per-expert counts stay on the device (the grids are
upper bounds), so a launch never synchronises.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from dist_moe.kernels.configs import (
    RowConfig,
    WeightConfig,
    choose,
    row_candidates,
    weight_candidates,
)
from dist_moe.kernels.row_gemm import (
    EPILOGUE_SCATTER,
    EPILOGUE_STORE,
    EPILOGUE_SWIGLU,
    EPILOGUE_SWIGLU_BWD,
    row_gemm_kernel,
    tile_map_kernel,
)
from dist_moe.kernels.weight_gemm import weight_gemm_kernel

try:  # host-built TMA descriptors (triton >= 3.4); without them every load uses pointers
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed triton
    TensorDescriptor = None

__all__ = ["EPILOGUE_SCATTER", "EPILOGUE_STORE", "EPILOGUE_SWIGLU", "EPILOGUE_SWIGLU_BWD", "RowOperands",
           "row_gemm", "weight_gemm"]


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # ignored by tl.dot for 16-bit inputs


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _aligned(t: Tensor) -> bool:
    return t.data_ptr() % 16 == 0


# A TMA box row wider than the widest shared-memory swizzle (128 bytes) is not used: such boxes
# are left to pointer loads rather than relying on the compiler to split them.
_TMA_MAX_INNER_BYTES = 128


def _a_descriptor(a: Tensor, rows: int, k: int, config: RowConfig):
    """TMA descriptor over A [rows, K] (row-major, 16-byte aligned), or None."""
    if TensorDescriptor is None or a.stride(1) != 1 or (a.stride(0) * a.element_size()) % 16 or not _aligned(a):
        return None
    if config.block_k * a.element_size() > _TMA_MAX_INNER_BYTES:
        return None
    return TensorDescriptor(a, [rows, k], [a.stride(0), 1], [config.block_m, config.block_k])


def _b_descriptor(b: Tensor, config: RowConfig):
    """TMA descriptor over the weights b [E, K, N] seen 2-D, or None when the layout does not allow it."""
    if TensorDescriptor is None or not _aligned(b):
        return None
    e, k, n = b.shape
    size = b.element_size()
    if (b.stride(1) == 1 and b.stride(0) == n * b.stride(2) and (b.stride(2) * size) % 16 == 0
            and config.block_k * size <= _TMA_MAX_INNER_BYTES):
        return TensorDescriptor(b, [e * n, k], [b.stride(2), 1], [config.block_n, config.block_k])
    # [E*K, N] rows cross experts at K, so a K tail would read the next expert: only when K is whole.
    if (b.stride(2) == 1 and b.stride(0) == k * b.stride(1) and (b.stride(1) * size) % 16 == 0
            and k % config.block_k == 0 and config.block_n * size <= _TMA_MAX_INNER_BYTES):
        return TensorDescriptor(b, [e * k, n], [b.stride(1), 1], [config.block_k, config.block_n])
    return None


@dataclass
class RowOperands:
    """What one row-tiled launch reads and writes (see row_gemm.py for the variants)."""

    a: Tensor  # [rows or inputs, K]
    b: Tensor  # [E, K, N] math layout (any strides)
    offsets: Tensor  # [E] int32 cumulative row ends
    out: Tensor  # [rows or slots, N]
    num_rows: int  # routed rows (sum of the group sizes, at most)
    slot: Tensor | None = None  # [rows] int32: row r reads a[slot[r] // top_k] (A_GATHER) / writes out[slot[r]]
    top_k: int = 1
    gather_a: bool = False
    a2: Tensor | None = None  # CONCAT_K: second A, same strides as a
    b2: Tensor | None = None  # TWO_B or CONCAT_K: second weight, same strides as b
    epilogue: int = EPILOGUE_STORE
    out2: Tensor | None = None
    out3: Tensor | None = None
    aux: tuple[Tensor, Tensor, Tensor] | None = None  # SWIGLU_BWD: gate, up, h [rows, N]
    weight: Tensor | None = None  # float32 [slots] routing weight, indexed by slot
    partial: Tensor | None = None  # SWIGLU_BWD with weight: float32 [cdiv(N, BLOCK_N), slots]
    save_preact: bool = False

    def role(self) -> str:
        if self.epilogue == EPILOGUE_SWIGLU_BWD:
            return "swiglu_bwd"
        if self.a2 is not None:
            return "concat"
        return "dual" if self.b2 is not None else "plain"


def row_gemm(ops: RowOperands, config: RowConfig | None = None) -> RowConfig:
    """Launch the row-tiled kernel (tuned on first use when `config` is None); returns the config used."""
    e, k, n = ops.b.shape
    if ops.num_rows == 0 or n == 0:
        return config or RowConfig()
    if config is not None:
        _launch_rows(ops, config)
        return config
    key = ("row", ops.role(), ops.epilogue, ops.gather_a, ops.a2 is not None, n, k, e, ops.a.dtype,
           tuple(ops.b.stride()[1:]) == (1, k), str(ops.a.device))
    chosen = choose(key, row_candidates(ops.role(), ops.a.device), lambda c: _launch_rows(ops, c))
    _launch_rows(ops, chosen)
    return chosen


def _launch_rows(ops: RowOperands, config: RowConfig) -> None:
    num_experts, k, n = ops.b.shape
    k2 = ops.a2.shape[1] if ops.a2 is not None else k
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if ops.partial is not None:
        assert ops.partial.shape[0] >= triton.cdiv(n, bn), "partial needs a row per N tile"
        ops.partial.zero_()  # rows past this config's N tiles must not keep another config's sums
    # Row tiles in use <= floor(rows / BLOCK_M) + E (each group adds at most one partial tile).
    max_row_tiles = ops.num_rows // bm + num_experts
    tile_info = torch.empty((max_row_tiles + 1) * 3, device=ops.a.device, dtype=torch.int32)
    block_e = triton.next_power_of_2(max(num_experts, 16))
    tile_map_kernel[(1,)](ops.offsets, tile_info, num_experts, max_row_tiles, BLOCK_M=bm, BLOCK_E=block_e,
                          BLOCK_T=max(16, 8192 // block_e), num_warps=4)
    max_tiles = max_row_tiles * triton.cdiv(n, bn)
    grid = (min(max_tiles, _num_sms(ops.a.device)) if config.persistent else max_tiles,)

    a_desc = a2_desc = b_desc = b2_desc = None
    if config.tma:
        if not ops.gather_a:
            a_desc = _a_descriptor(ops.a, ops.a.shape[0], k, config)
            if ops.a2 is not None:
                a2_desc = _a_descriptor(ops.a2, ops.a2.shape[0], k2, config)
                a_desc = a_desc if a2_desc is not None else None
        b_desc = _b_descriptor(ops.b, config)
        if ops.b2 is not None:
            b2_desc = _b_descriptor(ops.b2, config)
            if b2_desc is None or (ops.a2 is not None and k2 != k):
                b_desc = b2_desc = None
    b_k_contig = ops.b.stride(1) == 1
    if ops.b2 is not None:
        assert ops.b2.stride() == ops.b.stride(), "the two weights must share strides"
    if ops.a2 is not None:
        assert ops.a2.stride() == ops.a.stride(), "the two A operands must share strides"
    for t in (ops.out2, ops.out3, *(ops.aux or ())):
        assert t is None or t.stride() == ops.out.stride(), "outputs and saved activations must share strides"

    dummy = ops.out
    slot = ops.slot if ops.slot is not None else ops.offsets
    row_gemm_kernel[grid](
        ops.a, a_desc if a_desc is not None else ops.a,
        ops.a2 if ops.a2 is not None else ops.a, a2_desc if a2_desc is not None else ops.a,
        ops.b, b_desc if b_desc is not None else ops.b,
        ops.b2 if ops.b2 is not None else ops.b, b2_desc if b2_desc is not None else ops.b,
        ops.out, ops.out2 if ops.out2 is not None else dummy, ops.out3 if ops.out3 is not None else dummy,
        *(ops.aux if ops.aux is not None else (dummy, dummy, dummy)),
        tile_info, slot,
        ops.weight if ops.weight is not None else dummy,
        ops.partial if ops.partial is not None else dummy,
        n, k, k2, max_row_tiles, ops.out.shape[0], ops.top_k,
        ops.a.stride(0), ops.a.stride(1),
        ops.b.stride(0), ops.b.stride(1), ops.b.stride(2),
        ops.out.stride(0), ops.out.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
        A_GATHER=ops.gather_a, A_TMA=a_desc is not None, B_TMA=b_desc is not None, B_K_CONTIG=b_k_contig,
        TWO_B=ops.b2 is not None and ops.a2 is None, CONCAT_K=ops.a2 is not None,
        EPILOGUE=ops.epilogue, SAVE_PREACT=ops.save_preact, HAS_WEIGHT=ops.weight is not None,
        EVEN_K=(k % bk == 0 and k2 % bk == 0), EVEN_N=(n % bn == 0),
        DOT_PRECISION=_dot_precision(ops.a.dtype), FLATTEN=config.persistent and config.flatten,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def weight_gemm(
    *, p: Tensor, q: Tensor, offsets: Tensor, out: Tensor, q2: Tensor | None = None, out2: Tensor | None = None,
    slot: Tensor | None = None, top_k: int = 1, gather_p: bool = False, gather_q: bool = False,
    weight: Tensor | None = None, config: WeightConfig | None = None,
) -> WeightConfig:
    """out[e] = P[rows of e]^T @ Q[rows of e] for every expert e (zeros when it has no rows).

    out [E, KP, NQ] may have any strides; `weight` (float32 [slots]) scales Q's rows (Q_SCALE).
    Returns the configuration used.
    """
    num_experts, kp, nq = out.shape
    if num_experts == 0 or kp == 0 or nq == 0:
        return config or WeightConfig()
    if config is not None:
        _launch_weight(p, q, q2, out, out2, offsets, slot, weight, top_k, gather_p, gather_q, config)
        return config
    key = ("weight", gather_p, gather_q, weight is not None, q2 is not None, kp, nq, p.dtype,
           tuple(out.stride()), str(p.device))
    chosen = choose(key, weight_candidates(p.device, two_outputs=q2 is not None),
                    lambda c: _launch_weight(p, q, q2, out, out2, offsets, slot, weight, top_k, gather_p,
                                             gather_q, c))
    _launch_weight(p, q, q2, out, out2, offsets, slot, weight, top_k, gather_p, gather_q, chosen)
    return chosen


def _launch_weight(p, q, q2, out, out2, offsets, slot, weight, top_k, gather_p, gather_q,
                   config: WeightConfig) -> None:
    num_experts, kp, nq = out.shape
    bk, bn = config.block_k, config.block_n
    if q2 is not None:
        assert q2.stride() == q.stride() and out2 is not None and out2.stride() == out.stride()
    tiles = triton.cdiv(kp, bk) * triton.cdiv(nq, bn) * num_experts
    grid = (min(tiles, _num_sms(p.device)) if config.persistent else tiles,)
    weight_gemm_kernel[grid](
        p, q, q2 if q2 is not None else q, out, out2 if out2 is not None else out,
        offsets, slot if slot is not None else offsets, weight if weight is not None else out,
        kp, nq, top_k, num_experts,
        p.stride(0), p.stride(1), q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_K=bk, BLOCK_N=bn, BLOCK_R=config.block_r, GROUP_K=config.group_k,
        P_GATHER=gather_p, Q_GATHER=gather_q, Q_SCALE=weight is not None, TWO_Q=q2 is not None,
        EVEN_K=(kp % bk == 0), EVEN_N=(nq % bn == 0), DOT_PRECISION=_dot_precision(p.dtype),
        FLATTEN=config.persistent and config.flatten, num_warps=config.num_warps, num_stages=config.num_stages,
    )

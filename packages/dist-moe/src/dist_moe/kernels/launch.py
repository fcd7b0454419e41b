"""Launchers for the Triton kernels: argument checks, row-tile tables, TMA descriptors, grids, tuning keys.

Nothing here reads device data on the host: per-expert counts stay on the device (the grids are
upper bounds), so a launch never synchronises.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import triton
from torch import Tensor

from dist_moe.kernels.configs import (
    RowConfig,
    WeightConfig,
    choose,
    interpreting,
    row_candidates,
    weight_candidates,
)
from dist_moe.kernels.interpreter_backport import backport_scalar_index
from dist_moe.kernels.row_gemm import (
    EPILOGUE_SCATTER,
    EPILOGUE_STORE,
    EPILOGUE_SWIGLU,
    row_gemm_kernel,
)
from dist_moe.kernels.row_tiles import ROW_ALIGN, TILE_FIELDS, gather_rows_kernel, padded_rows, tile_map_kernel
from dist_moe.kernels.slot_sum import invert_slots_kernel, slot_sum_kernel
from dist_moe.kernels.swiglu_backward import swiglu_backward_kernel
from dist_moe.kernels.weight_gemm import weight_gemm_kernel
from dist_moe.kernels.weight_gemm_specialized import weight_gemm_specialized_kernel

try:  # host-built TMA descriptors (triton >= 3.4); without them every load uses pointers
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed triton
    TensorDescriptor = None

__all__ = ["EPILOGUE_SCATTER", "EPILOGUE_STORE", "EPILOGUE_SWIGLU", "RowOperands", "TileMaps",
           "gather_rows", "invert_slots", "row_gemm", "slot_sum", "swiglu_backward", "weight_gemm"]


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # ignored by tl.dot for 16-bit inputs


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _prepare() -> None:
    if interpreting():
        backport_scalar_index()


def _descriptor(t: Tensor, shape: list[int], row_stride: int, block: list[int]):
    """TMA descriptor over a row-major 2-D view of `t`, or None when the layout does not allow one.

    Box rows wider than the 128-byte swizzle are fine: the compiler splits them into several copies
    (python -m dist_moe.kernels.hopper_check shows the boxes it chose)."""
    size = t.element_size()
    if TensorDescriptor is None or t.data_ptr() % 16 or (row_stride * size) % 16 or min(shape) <= 0:
        return None
    return TensorDescriptor(t, shape, [row_stride, 1], block)


def _a_descriptor(a: Tensor, k: int, config: RowConfig):
    """Over A [rows, K] (row-major)."""
    if a.stride(1) != 1:
        return None
    return _descriptor(a, [a.shape[0], k], a.stride(0), [config.block_m, config.block_k])


def _b_descriptor(b: Tensor, config: RowConfig):
    """Over the weights b [E, K, N] seen 2-D, or None when the layout does not allow it."""
    e, k, n = b.shape
    if b.stride(1) == 1 and b.stride(0) == n * b.stride(2):
        return _descriptor(b, [e * n, k], b.stride(2), [config.block_n, config.block_k])
    # [E*K, N] rows cross experts at K, so a K tail would read the next expert: only when K is whole.
    if b.stride(2) == 1 and b.stride(0) == k * b.stride(1) and k % config.block_k == 0:
        return _descriptor(b, [e * k, n], b.stride(1), [config.block_k, config.block_n])
    return None


def _output_descriptor(out: Tensor, block_rows: int, block_cols: int):
    """TMA descriptor over a contiguous [E, rows, N] output seen as [E * rows, N], or None: rows must
    be whole tiles (a tile past an expert's last row would land in the next expert's)."""
    e, rows, n = out.shape
    if out.stride() != (rows * n, n, 1) or rows % block_rows:
        return None
    return _descriptor(out, [e * rows, n], n, [block_rows, block_cols])


@dataclass
class TileMaps:
    """Row-tile tables of one grouping of rows (`offsets` [E] int32 cumulative ends of `num_rows`
    rows), one per BLOCK_M, made on the device on first use; and the padded layout's expert ends."""

    offsets: Tensor
    num_rows: int
    _tables: dict[int, Tensor] = field(default_factory=dict)
    _padded_ends: Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.offsets.shape[0]

    @property
    def padded_rows(self) -> int:
        return padded_rows(self.num_rows, self.num_experts)

    def max_tiles(self, block_m: int) -> int:
        # Row tiles in use <= floor(rows / BLOCK_M) + E (each group adds at most one partial tile).
        return self.num_rows // block_m + self.num_experts

    def table(self, block_m: int) -> Tensor:
        if block_m not in self._tables:
            _prepare()
            max_tiles = self.max_tiles(block_m)
            device = self.offsets.device
            table = torch.empty((max_tiles + 1) * TILE_FIELDS, device=device, dtype=torch.int32)
            if self._padded_ends is None:
                self._padded_ends = torch.empty(self.num_experts, device=device, dtype=torch.int32)
            block_e = triton.next_power_of_2(max(self.num_experts, 16))
            tile_map_kernel[(1,)](self.offsets, table, self._padded_ends, self.num_experts, max_tiles,
                                  BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_T=max(16, 8192 // block_e),
                                  ALIGN=ROW_ALIGN, num_warps=4)
            self._tables[block_m] = table
        return self._tables[block_m]

    def padded_ends(self) -> Tensor:
        """[E] int32: each expert's end row in the padded layout."""
        if self._padded_ends is None:
            self.table(ROW_ALIGN)
        return self._padded_ends


_GATHER_BLOCK_M, _GATHER_BLOCK_C = 64, 128


def gather_rows(src: Tensor, slot: Tensor, top_k: int, maps: TileMaps) -> Tensor:
    """[padded rows, cols]: routed row r holds src[slot[r] // top_k] at its padded position, zeros in the padding."""
    src = src if src.stride(1) == 1 else src.contiguous()
    cols = src.shape[1]
    out = src.new_empty(maps.padded_rows, cols)
    if maps.num_rows == 0 or cols == 0:
        out.zero_()
        return out
    table = maps.table(_GATHER_BLOCK_M)
    max_tiles = maps.max_tiles(_GATHER_BLOCK_M)
    grid = (max_tiles, triton.cdiv(cols, _GATHER_BLOCK_C))
    gather_rows_kernel[grid](src, out, table, slot, max_tiles, cols, top_k, src.stride(0), out.stride(0),
                             BLOCK_M=_GATHER_BLOCK_M, BLOCK_C=_GATHER_BLOCK_C, num_warps=4)
    return out


def invert_slots(slot: Tensor) -> Tensor:
    """[R] int32 pos with pos[slot[r]] = r (`slot` a permutation of [0, R))."""
    pos = torch.empty_like(slot)
    if slot.numel():
        _prepare()
        block = 1024
        invert_slots_kernel[(triton.cdiv(slot.numel(), block),)](slot, pos, slot.numel(), BLOCK=block, num_warps=4)
    return pos


# Memory-bound: 16 rows x 256 columns, 4 warps moved 4.1 TB/s on the H200 (0.13 ms for top-8 of
# 4096 x 7168 bf16; 8x512/4, 32x128/4 and 4x1024/4 the same, 8-warp shapes 3.5-3.9 TB/s, torch's
# sum over [rows, top_k, C] 3.2: tools/bench/moe/probe_combine.py).
_SLOT_SUM_BLOCK_T, _SLOT_SUM_BLOCK_C, _SLOT_SUM_WARPS = 16, 256, 4


def slot_sum(routed: Tensor, pos: Tensor, top_k: int, weight: Tensor | None = None, *,
             block_t: int = _SLOT_SUM_BLOCK_T, block_c: int = _SLOT_SUM_BLOCK_C,
             num_warps: int = _SLOT_SUM_WARPS) -> Tensor:
    """[R / top_k, C]: out[t] = sum_j weight[t * top_k + j] * routed[pos[t * top_k + j]] (see slot_sum.py).

    routed [R, C] in expert order (columns contiguous), pos [R] int32 from `invert_slots`, weight
    (optional) float32 [R] indexed by slot."""
    num_routed, cols = routed.shape
    assert routed.stride(1) == 1 and pos.shape == (num_routed,) and num_routed % top_k == 0
    assert weight is None or weight.shape == (num_routed,)
    rows = num_routed // top_k
    out = routed.new_empty(rows, cols)
    if rows == 0 or cols == 0:
        return out
    _prepare()
    grid = (triton.cdiv(rows, block_t), triton.cdiv(cols, block_c))
    slot_sum_kernel[grid](routed, pos, weight if weight is not None else routed, out, rows, cols,
                          routed.stride(0), out.stride(0), TOP_K=top_k, HAS_WEIGHT=weight is not None,
                          BLOCK_T=block_t, BLOCK_C=block_c, num_warps=num_warps)
    return out


# Memory-bound: 64-row tiles, 128 columns per step at 8 warps moved 3.2 TB/s on the H200
# (0.294 ms for the layer's 940 MB; 64/8 0.305, 64/4 0.344, 32/4 0.395: tools/bench/moe/probe_variants.py).
_SWIGLU_BLOCK_C, _SWIGLU_WARPS = 128, 8


def swiglu_backward(dh: Tensor, saved: tuple[Tensor, Tensor, Tensor], outs: tuple[Tensor, Tensor, Tensor],
                    slot: Tensor, maps: TileMaps, weight: Tensor | None = None,
                    dweight: Tensor | None = None, *, block_c: int = _SWIGLU_BLOCK_C,
                    num_warps: int = _SWIGLU_WARPS) -> None:
    """SwiGLU backward of routed rows (see swiglu_backward.py).

    dh [rows, N] and saved = (gate, up, h) [rows, N] in expert order; outs = (dgate, dup, hw)
    [padded rows, N] in the padded layout (zeros in the padding). With `weight` (float32 [slots],
    indexed by slot) the gradients are scaled by it, and dweight [slots] float32 (when given)
    receives <dh, h>, the routing weight's gradient.
    """
    gate, up, h = saved
    dgate, dup, hw = outs
    assert dweight is None or weight is not None
    assert gate.stride() == up.stride() == h.stride() and dgate.stride() == dup.stride() == hw.stride()
    assert all(t.stride(1) == 1 for t in (dh, gate, dgate)), "columns must be contiguous"
    assert ROW_ALIGN * max(dh.stride(0), gate.stride(0), dgate.stride(0)) < 2**31, "tile offsets must fit int32"
    cols = dh.shape[1]
    if maps.num_rows == 0 or cols == 0:
        for out in outs:
            out.zero_()
        return
    _prepare()
    block_m = ROW_ALIGN  # the zero rows of an expert's last chunk lie in its last tile
    table = maps.table(block_m)
    max_tiles = maps.max_tiles(block_m)
    dummy = dh
    swiglu_backward_kernel[(max_tiles,)](
        dh, gate, up, h, dgate, dup, hw,
        weight if weight is not None else dummy, dweight if dweight is not None else dummy,
        table, slot, max_tiles, cols, dh.stride(0), gate.stride(0), dgate.stride(0),
        HAS_WEIGHT=weight is not None, WANT_DWEIGHT=dweight is not None, BLOCK_M=block_m, BLOCK_C=block_c,
        num_warps=num_warps)


@dataclass
class RowOperands:
    """What one row-tiled launch reads and writes (see row_gemm.py for the variants)."""

    a: Tensor  # [rows or inputs or padded rows, K]
    b: Tensor  # [E, K, N] math layout (any strides)
    offsets: Tensor  # [E] int32 cumulative row ends
    out: Tensor  # [rows or slots or padded rows, N]
    num_rows: int  # routed rows (sum of the group sizes, at most)
    slot: Tensor | None = None  # [rows] int32: row r reads a[slot[r] // top_k] (A_GATHER) / writes out[slot[r]]
    top_k: int = 1
    gather_a: bool = False
    padded_a: bool = False  # A (and A2) in the padded row layout
    a2: Tensor | None = None  # CONCAT_K: second A, same strides as a
    b2: Tensor | None = None  # TWO_B or CONCAT_K: second weight, same strides as b
    epilogue: int = EPILOGUE_STORE
    out2: Tensor | None = None
    out3: Tensor | None = None
    weight: Tensor | None = None  # float32 [slots] routing weight, indexed by slot
    save_preact: bool = False
    maps: TileMaps | None = None  # row-tile tables to reuse (made from offsets when None)

    def role(self) -> str:
        if self.a2 is not None:
            return "concat"
        if self.b2 is None:
            return "plain"
        return "dual" if self.gather_a else "dual_tma"


def row_gemm(ops: RowOperands, config: RowConfig | None = None) -> RowConfig:
    """Launch the row-tiled kernel (tuned on first use when `config` is None); returns the config used."""
    e, k, n = ops.b.shape
    if ops.num_rows == 0 or n == 0:
        return config or RowConfig()
    if ops.maps is None:
        ops.maps = TileMaps(ops.offsets, ops.num_rows)
    if config is not None:
        _launch_rows(ops, config)
        return config
    key = ("row", ops.role(), ops.epilogue, ops.gather_a, ops.padded_a, ops.a2 is not None, n, k, e, ops.a.dtype,
           ops.b.stride(1) == 1, str(ops.a.device))
    chosen = choose(key, row_candidates(ops.role(), ops.a.device, ops.a.dtype), lambda c: _launch_rows(ops, c))
    _launch_rows(ops, chosen)
    return chosen


def _launch_rows(ops: RowOperands, config: RowConfig) -> None:
    _prepare()
    num_experts, k, n = ops.b.shape
    k2 = ops.a2.shape[1] if ops.a2 is not None else k
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    maps = ops.maps or TileMaps(ops.offsets, ops.num_rows)
    tile_info = maps.table(bm)
    max_row_tiles = maps.max_tiles(bm)
    max_tiles = max_row_tiles * triton.cdiv(n, bn)
    grid = (min(max_tiles, _num_sms(ops.a.device)) if config.persistent else max_tiles,)

    a_desc = a2_desc = b_desc = b2_desc = None
    if config.tma:
        if not ops.gather_a:
            a_desc = _a_descriptor(ops.a, k, config)
            if ops.a2 is not None:
                a2_desc = _a_descriptor(ops.a2, k2, config)
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
    for t in (ops.out2, ops.out3):
        assert t is None or t.stride() == ops.out.stride(), "the outputs must share strides"

    dummy = ops.out
    slot = ops.slot if ops.slot is not None else ops.offsets
    row_gemm_kernel[grid](
        ops.a, a_desc if a_desc is not None else ops.a,
        ops.a2 if ops.a2 is not None else ops.a, a2_desc if a2_desc is not None else ops.a,
        ops.b, b_desc if b_desc is not None else ops.b,
        ops.b2 if ops.b2 is not None else ops.b, b2_desc if b2_desc is not None else ops.b,
        ops.out, ops.out2 if ops.out2 is not None else dummy, ops.out3 if ops.out3 is not None else dummy,
        tile_info, slot,
        ops.weight if ops.weight is not None else dummy,
        n, k, k2, max_row_tiles, ops.top_k,
        ops.a.stride(0), ops.a.stride(1),
        ops.b.stride(0), ops.b.stride(1), ops.b.stride(2),
        ops.out.stride(0), ops.out.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
        A_GATHER=ops.gather_a, A_PADDED=ops.padded_a, A_TMA=a_desc is not None, B_TMA=b_desc is not None,
        B_K_CONTIG=b_k_contig, TWO_B=ops.b2 is not None and ops.a2 is None, CONCAT_K=ops.a2 is not None,
        EPILOGUE=ops.epilogue, SAVE_PREACT=ops.save_preact, HAS_WEIGHT=ops.weight is not None,
        EVEN_K=(k % bk == 0 and k2 % bk == 0), EVEN_N=(n % bn == 0),
        DOT_PRECISION=_dot_precision(ops.a.dtype), FLATTEN=config.persistent and config.flatten,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def weight_gemm(*, p: Tensor, q: Tensor, ends: Tensor, outs: tuple[Tensor, ...], padded: bool = False,
                config: WeightConfig | None = None) -> WeightConfig:
    """out[e] = P[rows of e]^T @ Q[rows of e] for every expert e (zeros when it has no rows).

    p [rows, KP], q [rows, NQ] row-major; `ends` [E] int32 each expert's end row (the padded ends
    when `padded`: then P and Q are in the padded row layout and go through TMA). `outs` is
    (out [E, KP, NQ],) or (out [E, S, NQ], out2 [E, KP - S, NQ]): P's first S columns give out, the
    rest out2. Outputs take any strides (NQ contiguous stores best). Returns the configuration used.
    """
    num_experts, split, nq = outs[0].shape
    kp = p.shape[1]
    assert q.shape[1] == nq and p.shape[0] == q.shape[0] and ends.shape[0] == num_experts
    assert len(outs) == 1 and split == kp or len(outs) == 2 and outs[1].shape == (num_experts, kp - split, nq)
    if num_experts == 0 or kp == 0 or nq == 0:
        return config or WeightConfig()
    if config is not None:
        _launch_weight(p, q, ends, outs, padded, config)
        return config
    key = ("weight", padded, kp, nq, split, p.dtype, tuple(outs[0].stride()), str(p.device))
    candidates = weight_candidates(p.device, p.dtype, tma=padded)
    chosen = choose(key, candidates, lambda c: _launch_weight(p, q, ends, outs, padded, c))
    _launch_weight(p, q, ends, outs, padded, chosen)
    return chosen


def _launch_weight(p: Tensor, q: Tensor, ends: Tensor, outs: tuple[Tensor, ...], padded: bool,
                   config: WeightConfig) -> None:
    _prepare()
    num_experts, split, nq = outs[0].shape
    kp = p.shape[1]
    bk, bn, br = config.block_k, config.block_n, config.block_r
    out = outs[0]
    out2 = outs[1] if len(outs) == 2 else out
    assert out2.stride() == out.stride(), "the two outputs must share strides"
    if len(outs) == 2 and split % bk:  # a tile would straddle the two outputs: one launch each
        _launch_weight(p[:, :split], q, ends, outs[:1], padded, config)
        _launch_weight(p[:, split:], q, ends, outs[1:], padded, config)
        return
    if config.warp_specialize:
        if _launch_weight_specialized(p, q, ends, outs, padded, config):
            return
        # A layout it cannot take: the flattened kernel, with 8 warps for a 128x256 tile (the specialized
        # kernel's 4 are per warp group; one group of 4 holding that accumulator spills registers).
        wide = config.block_k * config.block_n >= 128 * 256
        config = dataclasses.replace(config, warp_specialize=False,
                                     num_warps=max(config.num_warps, 8) if wide else config.num_warps)
    p_desc = q_desc = None
    if padded:
        assert ROW_ALIGN % br == 0, "padded experts are whole ROW_ALIGN chunks"
        if p.stride(1) == 1 and q.stride(1) == 1:
            p_desc = _descriptor(p, [p.shape[0], kp], p.stride(0), [br, bk])
            q_desc = _descriptor(q, [q.shape[0], nq], q.stride(0), [br, bn])
            if p_desc is None or q_desc is None:
                p_desc = q_desc = None
    out_desc = out2_desc = None
    if config.store_tma:
        out_desc, out2_desc = (_output_descriptor(t, bk, bn) for t in (out, out2))
        if out_desc is None or out2_desc is None:
            out_desc = out2_desc = None
    tiles = triton.cdiv(kp, bk) * triton.cdiv(nq, bn) * num_experts
    grid = (min(tiles, config.per_sm * _num_sms(p.device)) if config.persistent else tiles,)
    weight_gemm_kernel[grid](
        p, p_desc if p_desc is not None else p, q, q_desc if q_desc is not None else q, out, out2,
        out_desc if out_desc is not None else out, out2_desc if out2_desc is not None else out, ends,
        kp, nq, split, num_experts,
        p.stride(0), p.stride(1), q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_K=bk, BLOCK_N=bn, BLOCK_R=br, GROUP_K=config.group_k,
        BLOCK_E=triton.next_power_of_2(max(num_experts, 16)), TMA=p_desc is not None,
        OUT_TMA=out_desc is not None, EVEN_K=(kp % bk == 0), EVEN_N=(nq % bn == 0),
        DOT_PRECISION=_dot_precision(p.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


SPECIALIZED_BLOCK_R = 64  # the row step checked against float64 on a GPU for the warp-specialized kernel


def _launch_weight_specialized(p: Tensor, q: Tensor, ends: Tensor, outs: tuple[Tensor, ...], padded: bool,
                               config: WeightConfig) -> bool:
    """The warp-specialized kernel, when the operands allow it (padded; row-major operands and
    contiguous outputs of whole tiles, 16-byte aligned rows); False leaves the launch to the flattened
    kernel."""
    num_experts, split, nq = outs[0].shape
    rows, kp = p.shape
    tensors = (p, q, *outs)
    if (not padded or p.stride(1) != 1 or q.stride(1) != 1 or not all(t.is_contiguous() for t in outs)
            or any(t.data_ptr() % 16 or (t.stride(-2) * t.element_size()) % 16 for t in tensors)
            or (split * p.element_size()) % 16 or any(t.shape[1] % config.block_k for t in outs)):
        return False
    assert ROW_ALIGN % config.block_r == 0, "padded experts are whole ROW_ALIGN chunks"
    if config.block_r != SPECIALIZED_BLOCK_R and not interpreting():
        raise ValueError(f"WeightConfig(warp_specialize=True) takes block_r={SPECIALIZED_BLOCK_R} on a GPU, got "
                         f"{config.block_r}: 128x256x32 at 5 stages gave NaN on an H100 (triton 3.6), and only "
                         f"64-row steps have been checked there")
    _prepare()
    _ensure_triton_allocator()
    for out, columns in zip(outs, (p[:, :split], p[:, split:])):  # one launch per output (see the kernel)
        tiles = triton.cdiv(out.shape[1], config.block_k) * triton.cdiv(nq, config.block_n) * num_experts
        weight_gemm_specialized_kernel[(min(tiles, config.per_sm * _num_sms(p.device)),)](
            columns, q, out, ends, rows, out.shape[1], nq, num_experts, columns.stride(0), q.stride(0),
            BLOCK_K=config.block_k, BLOCK_N=config.block_n, BLOCK_R=config.block_r, GROUP_K=config.group_k,
            WARP_SPECIALIZE=True, num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return True


def _scratch(size: int, alignment: int, stream) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


def _ensure_triton_allocator() -> None:
    """Descriptors made in a kernel need scratch memory from Triton's allocator. Its setting is per
    thread (a ContextVar) and autograd runs the backward on a thread of its own, so each launch
    checks; an allocator the user set is kept."""
    if interpreting():
        return
    from triton.runtime import _allocation  # triton has no public getter for the current allocator

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)

"""A bucket: parameters communicated together — one all-gather and one reduce-scatter per step.

All-gather buffer (bytes), one segment per rank, every entry 16-byte aligned:
    [RowShard slots (same offsets on every rank) | Owned/BlockShard pieces of that rank | pad] x W
  RowShard slot: ceil(rows/W) rows in the gather dtype (fully_shard's padded layout).
  Owned/BlockShard: the rank's rectangles back to back in the gather dtype, or with
  quantize="fp8_e4m3": [fp32 scale per tile | e4m3 bytes of the rectangles].
Reduce-scatter buffer (reduce dtype), the same idea in elements:
    [RowShard slots | Owned/BlockShard pieces of that rank | one "had a gradient" flag per slot | pad] x W
Segments differ in length (an owner holds a whole matrix), so each is padded to the longest.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .chunked import ChunkedShard
from .collectives import all_gather_single, reduce_scatter_single
from .placements import BlockShard
from .quantize import FP8, GatheredFP8, attach_gathered_fp8, dequantize_blockwise, quantize_blockwise
from .slot import ParamSlot, local_flat

ALIGN = 16  # bytes; keeps every dtype view of the uint8 buffer aligned


def _align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


class BucketState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # all-gather in flight
    UNSHARDED = "unsharded"


@dataclass(frozen=True)
class _Entry:
    offset: int  # into the rank's segment (bytes for all-gather, elements for reduce-scatter)
    size: int  # bytes / elements
    scale_bytes: int = 0  # fp8 entries: leading fp32 scales


class Bucket:
    def __init__(
        self,
        *,
        index: int,
        slots: list[ParamSlot],
        mesh,
        device: torch.device,
        reduce_dtype: torch.dtype | None,
        reshard_after_forward: bool,
        trigger: nn.Module,
        trigger_name: str,
    ) -> None:
        self.index = index
        self.slots = slots
        self.mesh = mesh
        self.group = mesh.get_group()
        self.rank = mesh.get_local_rank()
        self.world = mesh.size()
        self.device = device
        self.reshard_after_forward = reshard_after_forward
        self.trigger, self.trigger_name = trigger, trigger_name
        # Rows first so their offsets agree across ranks (one strided copy per parameter).
        self.order = sorted(range(len(slots)), key=lambda i: not slots[i].is_row)
        self.reduce_dtype = reduce_dtype
        self._plan()
        self.state = BucketState.SHARDED
        self._ag: tuple[dist.Work, torch.Tensor, torch.Tensor] | None = None
        self._rs: tuple[dist.Work, torch.Tensor, torch.Tensor] | None = None
        self.reset_iteration()

    # ---- layout ----

    def _plan(self) -> None:
        W = self.world
        self.ag: list[list[_Entry | None]] = [[None] * len(self.slots) for _ in range(W)]
        self.rs: list[list[_Entry | None]] = [[None] * len(self.slots) for _ in range(W)]
        ag_ends, rs_ends = [], []
        rs_dtypes = {self._rs_dtype(s) for s in self.slots} or {torch.float32}
        assert len(rs_dtypes) == 1, "one reduce dtype per bucket"
        self.rs_dtype = rs_dtypes.pop()
        for rank in range(W):
            ag_off = rs_off = 0
            for i in self.order:
                slot, layout = self.slots[i], self.slots[i].layout
                esz = slot.gather_dtype.itemsize
                numel = layout.row_slot_numel if slot.is_row else layout.local_numel(rank)
                if self._fp8(slot):
                    scale_bytes = 4 * layout.tiles(rank)
                    self.ag[rank][i] = _Entry(ag_off, scale_bytes + numel, scale_bytes)
                else:
                    self.ag[rank][i] = _Entry(ag_off, numel * esz)
                ag_off = _align(ag_off + self.ag[rank][i].size)
                self.rs[rank][i] = _Entry(rs_off, numel)
                rs_off += numel
            ag_ends.append(ag_off)
            rs_ends.append(rs_off)
        self.flag_offset = max(rs_ends)  # per-slot "had a gradient" flags, same offset on every rank
        self.ag_segment = max(max(ag_ends), ALIGN)
        self.rs_segment = _align(self.flag_offset + len(self.slots), ALIGN // self.rs_dtype.itemsize or 1)

    def _rs_dtype(self, slot: ParamSlot) -> torch.dtype:
        return self.reduce_dtype or slot.gather_dtype

    @staticmethod
    def _fp8(slot: ParamSlot) -> bool:
        p = slot.layout.placement
        return isinstance(p, BlockShard) and p.quantize == "fp8_e4m3"

    @property
    def requires_grad(self) -> bool:
        return any(s.sharded.requires_grad for s in self.slots)

    def all_gather_bytes(self) -> int:
        return self.ag_segment * self.world

    def reduce_scatter_bytes(self) -> int:
        return self.rs_segment * self.world * self.rs_dtype.itemsize

    def reset_iteration(self) -> None:
        self.expected_signals = 0  # forward calls that registered a post-backward signal
        self.signals = 0
        self.unsignalled_forward = False  # a grad-enabled forward whose inputs carried no grad
        self.forwarded = False
        self.backward_started = False
        self.reduced = False

    # ---- all-gather ----

    def launch_gather(self) -> torch.Tensor | None:
        """Start the all-gather; returns the receive buffer [W * segment] uint8 (for inspection)."""
        if self.state is not BucketState.SHARDED:
            return None
        send = torch.empty(self.ag_segment, dtype=torch.uint8, device=self.device)
        for i, slot in enumerate(self.slots):
            self._pack_param(slot, self.ag[self.rank][i], send)
        recv = torch.empty(self.ag_segment * self.world, dtype=torch.uint8, device=self.device)
        work = all_gather_single(recv, send, group=self.group, async_op=True)
        self._ag = (work, send, recv)
        self.state = BucketState.GATHERING
        return recv

    def wait_gather(self) -> None:
        if self.state is not BucketState.GATHERING:
            return
        work, _, recv = self._ag
        work.wait()
        self._ag = None
        segments = recv.view(self.world, self.ag_segment)
        for i, slot in enumerate(self.slots):
            full = slot.alloc_unsharded(self.device)
            # Refilling storage that autograd saved in forward is expected: keep the version counter.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(full):
                self._unpack_param(slot, i, segments, full)
        self.state = BucketState.UNSHARDED

    def unshard(self) -> None:
        self.launch_gather()
        self.wait_gather()

    def reshard(self) -> None:
        if self.state is BucketState.GATHERING:
            self.wait_gather()
        for slot in self.slots:
            if slot.unsharded is not None and self._fp8(slot):
                attach_gathered_fp8(slot.unsharded, None)
            slot.free_unsharded()
        self.state = BucketState.SHARDED

    def _pack_param(self, slot: ParamSlot, entry: _Entry, send: torch.Tensor) -> None:
        local = slot.local_flat()
        region = send[entry.offset : entry.offset + entry.size]
        if self._fp8(slot):
            self._pack_fp8(slot, local, region, entry.scale_bytes)
        else:
            region.view(slot.gather_dtype)[: local.numel()].copy_(local)

    def _pack_fp8(self, slot: ParamSlot, local: torch.Tensor, region: torch.Tensor, scale_bytes: int) -> None:
        block, rule = slot.layout.placement.block, slot.layout.placement.scales
        scales, data = region[:scale_bytes].view(torch.float32), region[scale_bytes:].view(FP8)
        s_off = d_off = 0
        for rect in slot.layout.rects[self.rank]:
            # Quantize what a bf16 gather would have carried, so fp8 == gather-then-quantize bitwise.
            piece = local[d_off : d_off + rect.numel].view(rect.sizes).to(slot.gather_dtype)
            q, s = quantize_blockwise(piece, block, rule)
            data[d_off : d_off + rect.numel].copy_(q.view(-1))
            scales[s_off : s_off + s.numel()].copy_(s.view(-1))
            d_off += rect.numel
            s_off += s.numel()

    def _unpack_param(self, slot: ParamSlot, i: int, segments: torch.Tensor, full: torch.Tensor) -> None:
        layout = slot.layout
        if slot.is_row:
            entry = self.ag[0][i]  # same on every rank
            rows = layout.shape[0]
            chunk = math.ceil(rows / self.world)
            if chunk == 0:
                return
            inner = full.numel() // rows
            src = segments[:, entry.offset : entry.offset + entry.size].view(slot.gather_dtype)
            _copy_rows(full.view(rows, inner), src.view(self.world, chunk, inner), into_full=True)
            return
        if self._fp8(slot):
            # Assembled whole (one dequantize), and kept for fp8 consumers until reshard (flexshard.gathered_fp8).
            q, scales = self.gathered_fp8(i, segments)
            placement = layout.placement
            full.copy_(dequantize_blockwise(q, scales, placement.block, full.dtype))
            attach_gathered_fp8(full, GatheredFP8(q=q, scales=scales, block=placement.block, rule=placement.scales))
            return
        for rank in range(self.world):
            entry = self.ag[rank][i]
            data, off = segments[rank, entry.offset : entry.offset + entry.size].view(slot.gather_dtype), 0
            for rect in layout.rects[rank]:
                full[rect.slices].copy_(data[off : off + rect.numel].view(rect.sizes))
                off += rect.numel

    def gathered_fp8(self, i: int, segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The full e4m3 matrix and per-tile scales carried by a gathered buffer."""
        slot = self.slots[i]
        block = slot.layout.placement.block
        rows, cols = slot.layout.shape
        q = torch.empty(rows, cols, dtype=FP8, device=segments.device)
        scales = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]), device=segments.device)
        for rank in range(self.world):
            entry = self.ag[rank][i]
            region = segments[rank, entry.offset : entry.offset + entry.size]
            sc, data = region[: entry.scale_bytes].view(torch.float32), region[entry.scale_bytes :].view(FP8)
            s_off = d_off = 0
            for rect in slot.layout.rects[rank]:
                tr, tc = math.ceil(rect.sizes[0] / block[0]), math.ceil(rect.sizes[1] / block[1])
                q[rect.slices] = data[d_off : d_off + rect.numel].view(rect.sizes)
                r0, c0 = rect.offsets[0] // block[0], rect.offsets[1] // block[1]
                scales[r0 : r0 + tr, c0 : c0 + tc] = sc[s_off : s_off + tr * tc].view(tr, tc)
                d_off += rect.numel
                s_off += tr * tc
        return q, scales

    # ---- reduce-scatter ----

    def launch_reduce(self) -> None:
        """Pack every rank's share of the unsharded gradients and start the reduce-scatter."""
        assert self._rs is None
        W = self.world
        send = torch.zeros(W, self.rs_segment, dtype=self.rs_dtype, device=self.device)
        for i, slot in enumerate(self.slots):
            grad = slot.unsharded.grad if slot.unsharded is not None else None
            if grad is None:
                continue
            send[:, self.flag_offset + i] = 1.0
            layout = slot.layout
            if slot.is_row:
                rows = layout.shape[0]
                chunk = math.ceil(rows / W)
                if chunk:
                    entry = self.rs[0][i]
                    inner = grad.numel() // rows
                    dst = send[:, entry.offset : entry.offset + entry.size].view(W, chunk, inner)
                    _copy_rows(grad.reshape(rows, inner), dst, into_full=False)
                continue
            for rank in range(W):
                entry, off = self.rs[rank][i], 0
                for rect in layout.rects[rank]:
                    send[rank, entry.offset + off : entry.offset + off + rect.numel].view(rect.sizes).copy_(grad[rect.slices])
                    off += rect.numel
        for slot in self.slots:  # packed: the unsharded gradients can go
            if slot.unsharded is not None:
                slot.unsharded.grad = None
        recv = torch.empty(self.rs_segment, dtype=self.rs_dtype, device=self.device)
        # fp32/bf16 sums cannot overflow, so let the collective average (what fully_shard does).
        avg = self.rs_dtype in (torch.float32, torch.bfloat16) and W > 1
        op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
        work = reduce_scatter_single(recv, send.view(-1), op=op, group=self.group, async_op=True)
        self._rs = (work, send, recv)
        self._rs_divide = not avg and W > 1

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter and write (or accumulate into) the sharded gradients."""
        if self._rs is None:
            return
        work, _, recv = self._rs
        work.wait()
        self._rs = None
        if self._rs_divide:
            recv.div_(self.world)
        had_grad = recv[self.flag_offset : self.flag_offset + len(self.slots)].tolist()
        with torch.no_grad():
            for i, slot in enumerate(self.slots):
                if had_grad[i] <= 0:
                    continue  # no rank produced a gradient for it
                param = slot.sharded
                entry = self.rs[self.rank][i]
                numel = slot.layout.local_numel(self.rank)
                flat = recv[entry.offset : entry.offset + numel].to(param.dtype)
                if param.grad is not None:
                    local_flat(param.grad).add_(flat)
                else:
                    param.grad = _as_sharded(flat, slot, self.mesh)


def _copy_rows(full: torch.Tensor, chunks: torch.Tensor, *, into_full: bool) -> None:
    """Copy between full [rows, inner] and torch.chunk-padded chunks [W, chunk, inner] (either way)."""
    rows = full.shape[0]
    W, chunk, _ = chunks.shape
    whole, rem = divmod(rows, chunk)
    whole = min(whole, W)
    pairs = [(full[: whole * chunk].view(whole, chunk, -1), chunks[:whole])]
    if rem and whole < W:
        pairs.append((full[whole * chunk :], chunks[whole, :rem]))
    for f, c in pairs:
        (f if into_full else c).copy_(c if into_full else f)


def _as_sharded(flat: torch.Tensor, slot: ParamSlot, mesh) -> DTensor:
    """Wrap local elements as a DTensor shaped like the slot's sharded parameter."""
    layout = slot.layout
    if slot.is_row:
        rect = layout.rects[slot.rank][0]
        local = flat.view(rect.sizes)
    else:
        local = ChunkedShard(flat, layout, slot.rank)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(layout.shape), stride=contiguous_stride(layout.shape))


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()

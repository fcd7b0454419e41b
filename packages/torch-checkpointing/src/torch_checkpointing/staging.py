"""Copying the state to host memory so it may change while the copy is written out.

Pieces are cut into segments and packed into equal host "slabs" (pinned on CUDA, reused across saves:
allocating pinned memory is slow, and equal power-of-two slabs waste nothing in torch's pinned
allocator). CUDA copies run on a side stream, one event per slab, so the writer starts on the first
slab while later ones are still copying, and the trainer's own stream continues. CPU copies are made
by the saving thread after the writer has started, one HostEvent per slab, so they overlap the writes too.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .file_format import tensor_bytes
from .layout import Piece
from .storage import DIRECT_ALIGNMENT as PAGE_BYTES  # where a segment's whole pages can go direct

SEGMENT_ALIGNMENT = 4096


@dataclass(slots=True)
class Segment:
    piece: int
    start: int  # byte offset within the piece
    nbytes: int
    rows: tuple[int, int] | None  # rows [r0, r1) of a non-contiguous source; None: flat bytes
    slab: int
    slab_offset: int


@dataclass(slots=True)
class StagingPlan:
    segments: list[Segment]
    slab_bytes: int
    num_slabs: int


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def plan_staging(pieces: list[Piece], sources: list[torch.Tensor], *, slab_bytes: int,
                 block_bytes: int = SEGMENT_ALIGNMENT) -> StagingPlan:
    """Segments of at most one slab each, packed into slabs in file order.

    Flat segments are cut at multiples of slab_bytes (a multiple of the checksum block size), so
    checksum blocks stay aligned to the piece; non-contiguous sources (boxes of a strided shard)
    are cut at row boundaries and copied with their strides. Each segment sits in its slab at the
    offset it has in the data file modulo a page (see _file_phases), so its whole pages can go to the
    disk by direct I/O even when an odd-sized tensor before it shifted it off the page grid.
    """
    phases = _file_phases(pieces)
    cuts: list[tuple[int, int, int, tuple[int, int] | None]] = []
    for index, (piece, source) in enumerate(zip(pieces, sources)):
        if source.is_contiguous():
            # off the page grid: one block shorter, so the segment still fits a slab once shifted
            step = slab_bytes - block_bytes if phases[index] and slab_bytes > block_bytes else slab_bytes
            for start in range(0, piece.nbytes, step):
                cuts.append((index, start, min(step, piece.nbytes - start), None))
        else:
            row_bytes = piece.nbytes // piece.shape[0]
            slab_bytes = max(slab_bytes, _next_power_of_two(row_bytes))
            rows_per = max(1, slab_bytes // row_bytes)
            for r0 in range(0, piece.shape[0], rows_per):
                r1 = min(piece.shape[0], r0 + rows_per)
                cuts.append((index, r0 * row_bytes, (r1 - r0) * row_bytes, (r0, r1)))
    segments, slab, offset = [], 0, 0
    for index, start, nbytes, rows in cuts:
        phase = (phases[index] + start) % PAGE_BYTES
        if phase + nbytes > slab_bytes or (rows is not None and phase % pieces[index].dtype.itemsize):
            phase = 0  # does not fit shifted, or a strided copy needs its dtype's alignment: written buffered
        at = _round_up(offset, SEGMENT_ALIGNMENT) + phase
        if at + nbytes > slab_bytes:
            slab, at = slab + 1, phase
        segments.append(Segment(index, start, nbytes, rows, slab, at))
        offset = at + nbytes
    if slab == 0:  # a state smaller than a slab: no need to allocate (and pin, or touch) a whole one
        slab_bytes = min(slab_bytes, _next_power_of_two(max(_round_up(offset, SEGMENT_ALIGNMENT), SEGMENT_ALIGNMENT)))
    return StagingPlan(segments, slab_bytes, slab + 1 if segments else 0)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _file_phases(pieces: list[Piece]) -> list[int]:
    """Each piece's offset in the data file modulo a page: the pieces follow a page-padded header
    back to back (rank_writer), so one odd-sized tensor shifts every piece after it."""
    phases, position = [], 0
    for piece in pieces:
        phases.append(position % PAGE_BYTES)
        position += piece.nbytes
    return phases


class HostPool:
    """Reusable host slabs; pinned when the state lives on CUDA."""

    def __init__(self) -> None:
        self.slabs: list[torch.Tensor] = []
        self.slab_bytes = 0
        self.pinned = False

    def take(self, count: int, slab_bytes: int, pinned: bool, *, touch: bool = False) -> list[torch.Tensor]:
        """`count` slabs, allocated where missing. touch: write new unpinned slabs once, so the first
        staging copy does not pay the page faults (pinned memory is resident when allocated)."""
        if slab_bytes > self.slab_bytes or pinned != self.pinned:  # larger slabs serve smaller plans too
            self.slabs, self.slab_bytes, self.pinned = [], slab_bytes, pinned
        while len(self.slabs) < count:  # kept at the largest save's size: pinned allocation is slow
            if pinned:  # cudaHostAlloc memory starts on a page
                slab = torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=True)
            else:  # start on a page, as direct I/O needs (CPU allocations are only 64-byte aligned)
                base = torch.empty(self.slab_bytes + PAGE_BYTES, dtype=torch.uint8)
                start = -base.data_ptr() % PAGE_BYTES
                slab = base[start:start + self.slab_bytes]
                if touch:
                    slab.zero_()
            self.slabs.append(slab)
        return self.slabs[:count]

    def release(self) -> None:
        self.slabs = []


class HostEvent:
    """A slab's CPU copies are done: what a CUDA event says for a GPU slab, for copies made on the host.

    Set by copy_on_host() while the writer already writes the slabs before it; `failed` makes a waiting
    writer raise instead of waiting for a copy that will not come."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.failed: BaseException | None = None

    def set(self, failed: BaseException | None = None) -> None:
        self.failed = failed
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.failed is not None:
            raise RuntimeError(f"staging the state to host memory failed: {self.failed!r}") from self.failed


@dataclass(slots=True)
class Staged:
    """Where each segment's bytes are once ready, and the events (CUDA or HostEvent) that say when."""

    memory: list[memoryview]
    events: list[list[torch.cuda.Event | HostEvent]]  # per segment: wait on these before reading its memory
    keepalive: list[object]  # sources read by in-flight copies must outlive them
    finished: dict[torch.device, torch.cuda.Event]  # per device: recorded after its last copy
    host_copies: list[tuple[Callable[[], None], HostEvent | None]] = field(default_factory=list)

    def copy_on_host(self) -> None:
        """Run the CPU copies in file order, setting each slab's HostEvent once its copies are done (a
        writer started before this writes the first slabs while later ones are still copying). Returns
        when every copy is done: the state may change then. On failure the waiting writer raises too."""
        copies, self.host_copies = self.host_copies, []
        try:
            for copy, done in copies:
                copy()
                if done is not None:
                    done.set()
        except BaseException as e:
            for _, done in copies:
                if done is not None and not done.query():
                    done.set(failed=e)
            raise

    def ready(self) -> bool:
        return all(e.query() for evs in self.events for e in evs)

    def wait(self) -> None:
        for evs in self.events:
            for e in evs:
                e.synchronize()

    def order_current_streams(self) -> None:
        """Work queued on each device's current stream from now on runs after the copies (no host wait)."""
        for device, event in self.finished.items():
            torch.cuda.current_stream(device).wait_event(event)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def stage(
    plan: StagingPlan,
    pieces: list[Piece],
    sources: list[torch.Tensor],
    pool: HostPool,
    streams: dict[torch.device, torch.cuda.Stream],
    *,
    direct_cpu: bool,
) -> Staged:
    """Start copying every segment to host slabs: CUDA copies are queued on the side streams; CPU copies
    are left to Staged.copy_on_host(), which the caller runs once the writer is started (so it overlaps).

    direct_cpu: contiguous CPU sources are written straight from the state (a blocking save, where
    the state cannot change before the write ends), skipping the copy.
    """
    on_cuda = any(s.device.type == "cuda" for s in sources)
    slabs = pool.take(plan.num_slabs, plan.slab_bytes, pinned=on_cuda)
    slab_bytes = [tensor_bytes(s) for s in slabs]
    memory: list[memoryview] = []
    events: list[list[torch.cuda.Event]] = [[] for _ in plan.segments]
    for device, stream in streams.items():
        stream.wait_stream(torch.cuda.current_stream(device))  # copy the values as of this call
    pending: dict[torch.device, list[int]] = {}  # device -> segments whose copy awaits an event
    host_copies: list[tuple[Callable[[], None], HostEvent | None]] = []
    on_host: list[int] = []  # segments of the current slab copied on the host

    def record_events() -> None:
        for device, waiting in pending.items():
            event = torch.cuda.Event(blocking=True)  # waiting threads sleep instead of spinning
            event.record(streams[device])
            for j in waiting:
                events[j].append(event)
        pending.clear()
        if on_host:  # the slab's last host copy sets it
            done = HostEvent()
            host_copies[-1] = (host_copies[-1][0], done)
            for j in on_host:
                events[j].append(done)
            on_host.clear()

    for i, seg in enumerate(plan.segments):
        piece, source = pieces[seg.piece], sources[seg.piece]
        if direct_cpu and source.device.type == "cpu" and seg.rows is None:
            memory.append(tensor_bytes(_flat_bytes(source))[seg.start:seg.start + seg.nbytes])
        else:
            dst = slabs[seg.slab][seg.slab_offset:seg.slab_offset + seg.nbytes]
            memory.append(slab_bytes[seg.slab][seg.slab_offset:seg.slab_offset + seg.nbytes])
            if source.device.type == "cuda":
                with torch.cuda.stream(streams[source.device]):
                    _copy_segment(dst, source, piece, seg, non_blocking=True)
                pending.setdefault(source.device, []).append(i)
            else:
                host_copies.append((functools.partial(_copy_segment, dst, source, piece, seg, non_blocking=False), None))
                on_host.append(i)
        if i + 1 == len(plan.segments) or plan.segments[i + 1].slab != seg.slab:
            record_events()  # one event per slab: its segments are written as soon as it is complete
    finished = {}
    for device, stream in streams.items():
        finished[device] = torch.cuda.Event()
        finished[device].record(stream)
    return Staged(memory, events, keepalive=[sources, slabs], finished=finished, host_copies=host_copies)


def _copy_segment(dst: torch.Tensor, source: torch.Tensor, piece: Piece, seg: Segment, *, non_blocking: bool) -> None:
    if seg.rows is None:
        dst.copy_(_flat_bytes(source)[seg.start:seg.start + seg.nbytes], non_blocking=non_blocking)
    else:
        r0, r1 = seg.rows
        dst.view(piece.dtype).view((r1 - r0, *piece.shape[1:])).copy_(source[r0:r1], non_blocking=non_blocking)

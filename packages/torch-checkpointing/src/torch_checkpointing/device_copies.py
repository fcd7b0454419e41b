"""Host-to-device copies of a load: pinned chunk buffers that the read threads fill, reused once copied.

A GPU target cannot be read into: each chunk is read into a pinned host buffer, then copied to the
device on the load stream without waiting, so the thread that read it goes on to its next read while
the copy runs. A buffer goes back to the pool with the event of its copy and is waited for only when
taken again: with two buffers per read thread a thread waits only when the device copies fall behind
the disk (never, at 2.5 GB/s of disk against tens of GB/s of host-to-device copies). Where it fits, a
chunk starts in its buffer at its file offset modulo a page, so direct I/O (LocalStorage(direct_io=True))
reads its page-aligned middle straight into the buffer. Buffers are exactly chunk_bytes (a power of two):
torch's pinned allocator rounds sizes up to one, so a page more would pin twice the memory.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

import torch

from .storage import DIRECT_ALIGNMENT

_streams: dict[torch.device, torch.cuda.Stream] = {}  # one load stream per device, kept between loads


class DeviceCopies:
    """The copies of one load; `prepare` it on the loading thread, `finish` it when every read is done."""

    def __init__(self, chunk_bytes: int, buffers: int):
        self.chunk_bytes, self.buffers = chunk_bytes, buffers
        self._free: queue.SimpleQueue = queue.SimpleQueue()  # (pinned buffer, event of its last copy or None)
        self._made = 0
        self._lock = threading.Lock()
        self._used: set[torch.device] = set()

    def prepare(self, devices: set[torch.device]) -> None:
        """Order the load streams after the current ones: the targets may still be being initialized."""
        for device in devices:
            if device.type == "cuda":
                self._stream(device).wait_stream(torch.cuda.current_stream(device))

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device not in _streams:
                _streams[device] = torch.cuda.Stream(device)
            self._used.add(device)
            return _streams[device]

    def _take(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            make = self._made < self.buffers
            if make:
                self._made += 1
        if make:  # pinned lazily: a small load pins only what it uses
            return torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True), None
        return self._free.get()  # every buffer is out: the next one given back

    def to_device(self, dst: torch.Tensor, fill: Callable[[torch.Tensor], None], file_offset: int) -> None:
        """Fill the contiguous uint8 GPU tensor `dst`: `fill` writes its bytes (those at `file_offset` of a
        file) into the host buffer given to it, which is then copied to `dst` without waiting for the copy."""
        nbytes = dst.numel()
        if nbytes > self.chunk_bytes:  # a chunk cut at checksum blocks larger than a chunk: a buffer of its own
            host = torch.empty(nbytes + DIRECT_ALIGNMENT, dtype=torch.uint8, pin_memory=True)
            shift = (file_offset - host.data_ptr()) % DIRECT_ALIGNMENT
            fill(host[shift:shift + nbytes])
            self.copy(dst, host[shift:shift + nbytes])
            return
        buffer, event = self._take()
        try:
            if event is not None:
                event.synchronize()  # its last copy is done: the buffer may be overwritten
                event = None
            shift = (file_offset - buffer.data_ptr()) % DIRECT_ALIGNMENT
            if shift + nbytes > self.chunk_bytes:  # a whole chunk off the page grid: read buffered
                shift = 0
            host = buffer[shift:shift + nbytes]
            fill(host)
            stream = self._stream(dst.device)
            with torch.cuda.stream(stream):
                dst.copy_(host, non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # waited for asleep: the other threads need the CPU
                event.record(stream)
        finally:
            self._free.put((buffer, event))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src), waiting for it: `src` (host memory) may be reused as soon as this returns."""
        if dst.device.type != "cuda":
            dst.copy_(src)
            return
        stream = self._stream(dst.device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # waited for asleep: the other threads need the CPU
            event.record(stream)
        event.synchronize()

    def finish(self) -> None:
        """Wait for every copy queued: the targets are complete (for any stream) when this returns."""
        for device in self._used:
            _streams[device].synchronize()

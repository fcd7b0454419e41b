"""One rank's part of a save: its safetensors data file, then its JSON record (the "done" marker).

The record is written only after the data file is durable, so its presence tells the committing rank
that this rank is finished, without any process-group collective. It carries the data file's size and
header checksum and the tensors' block checksums, and ends with its own (integrity.sealed_json).
"""
from __future__ import annotations

import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from .file_format import (
    FORMAT, VERSION, block_checksums, data_file, dtype_name, failure_file, record_file, safetensors_header,
)
from .integrity import record_fields, sealed_json
from .layout import RankLayout
from .staging import Staged, StagingPlan
from .storage import Storage

# Bytes checksummed and then written at a time: small enough to stay in the CPU cache between the two
# (with every I/O thread doing the same), large enough that a write's system call costs nothing.
WRITE_CHUNK_BYTES = 4 << 20


@dataclass(slots=True)
class ExtraPiece:
    """A per-rank tensor or bytes value, copied at save time (small, its size may change per save)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview
    owner: object  # keeps the memory behind `data` alive


def write_rank(
    storage: Storage,
    directory: str,
    *,
    step: int,
    rank: int,
    layout: RankLayout,
    plan: StagingPlan,
    staged: Staged,
    extras: list[ExtraPiece],
    values: dict,
    block_bytes: int,
    io_pool: ThreadPoolExecutor,
    io_threads: int,
) -> str:
    """Write the data file and the record; returns the record's name."""
    entries = [(p.name, dtype_name(p.dtype, p.path), p.shape, p.nbytes) for p in layout.pieces]
    entries += [(e.name, e.dtype, e.shape, e.data.nbytes) for e in extras]
    header, offsets = safetensors_header(entries, {"format": FORMAT, "rank": str(rank), "step": str(step)})
    base = len(header)
    file_bytes = base + sum(e[3] for e in entries)
    blocks = _write_data_file(
        storage, directory, rank=rank, header=header, offsets=offsets, n_entries=len(entries),
        file_bytes=file_bytes, layout=layout,
        plan=plan, staged=staged, extras=extras, block_bytes=block_bytes, io_pool=io_pool,
        io_threads=io_threads,
    )
    record = {
        "format": FORMAT, "version": VERSION, "step": step, "rank": rank, "fingerprint": layout.fingerprint,
        "file": data_file(rank), **record_fields(header, file_bytes),
        "layout": layout.record, "stored": _stored_entries(entries, offsets, blocks, base), "values": values,
    }
    name = record_file(rank, layout.fingerprint)
    try:
        storage.write_file(f"{directory}/{name}", sealed_json(record))
    except BaseException:
        _report_failure(storage, directory, rank)
        raise
    return name


def _write_data_file(
    storage: Storage,
    directory: str,
    *,
    rank: int,
    header: bytes,
    offsets: list[int],
    n_entries: int,
    file_bytes: int,
    layout: RankLayout,
    plan: StagingPlan,
    staged: Staged,
    extras: list[ExtraPiece],
    block_bytes: int,
    io_pool: ThreadPoolExecutor,
    io_threads: int,
) -> list[list[list[int]]]:
    """Write the header, the staged segments and the extras into this rank's data file; returns each
    entry's block checksums (unsorted). On any failure the sink is aborted and the failure reported."""
    base = len(header)
    path = f"{directory}/{data_file(rank)}"
    blocks: list[list[list[int]]] = [[] for _ in range(n_entries)]
    sink = None
    try:
        sink = storage.open_sink(path)
        sink.preallocate(file_bytes)  # a full disk fails here, before any write
        sink.write_at(0, memoryview(header))

        chunks = _chunks(plan, staged, extras, offsets, base, n_pieces=len(layout.pieces), block_bytes=block_bytes)
        threads = io_threads if storage.parallel_writes else 1  # else in file order from this thread
        for index, crcs in _write_chunks(sink, chunks, block_bytes, io_pool, threads):
            blocks[index].extend(crcs)
        sink.finish()
    except BaseException:
        if sink is not None:
            sink.abort()
        _report_failure(storage, directory, rank)
        raise
    return blocks


@dataclass(slots=True)
class _Chunk:
    """Bytes written (and checksummed) as one: up to WRITE_CHUNK_BYTES of one entry's staged memory."""

    entry: int  # index of the file's entry (the layout's pieces, then the extras)
    offset: int  # where in the file
    data: memoryview
    start: int  # where in its entry (block checksum offsets count from there)
    events: list  # wait on these (the slab's staging copies) before reading `data`


def _chunks(plan: StagingPlan, staged: Staged, extras: list[ExtraPiece], offsets: list[int], base: int, *,
            n_pieces: int, block_bytes: int) -> list[_Chunk]:
    """The data file's bytes as chunks in file order, cut at multiples of the checksum block from each
    segment's start, so the blocks are the ones a whole-segment checksum pass would make."""
    step = max(block_bytes, WRITE_CHUNK_BYTES)  # both powers of two: chunks hold whole blocks
    parts = [(seg.piece, seg.start, staged.memory[i], staged.events[i]) for i, seg in enumerate(plan.segments)]
    parts += [(n_pieces + j, 0, e.data, []) for j, e in enumerate(extras)]
    chunks = []
    for entry, start, memory, events in parts:
        memory = memory.cast("B")
        for lo in range(0, max(len(memory), 1), step):  # an empty entry still gets its (empty) write
            chunks.append(_Chunk(entry, base + offsets[entry] + start + lo, memory[lo:lo + step], start + lo, events))
    return chunks


def _write_chunks(sink, chunks: list[_Chunk], block_bytes: int, pool: ThreadPoolExecutor,
                  threads: int) -> list[tuple[int, list[list[int]]]]:
    """Checksum and write every chunk; returns (entry, block checksums) per chunk.

    Each chunk is checksummed right before it is written, while still in the CPU cache (each byte comes
    from memory once, not twice, as with a checksum pass over a whole slab segment and then its write).
    `threads` threads take the next chunk in file order from one queue, so the writes in flight are
    neighbours and the disk's writeback runs close to sequentially (with one segment per thread it got
    `threads` streams far apart). Every thread has stopped when this returns or raises: the sink is
    closed after it.
    """
    if threads <= 1 or len(chunks) <= 1:
        return [_write_chunk(sink, c, block_bytes) for c in chunks]
    queue, lock, failed = iter(chunks), threading.Lock(), threading.Event()

    def work() -> list[tuple[int, list[list[int]]]]:
        done = []
        while not failed.is_set():
            with lock:
                chunk = next(queue, None)
            if chunk is None:
                break
            try:
                done.append(_write_chunk(sink, chunk, block_bytes))
            except BaseException:
                failed.set()  # the other threads stop at their next chunk
                raise
        return done

    futures = [pool.submit(work) for _ in range(min(threads, len(chunks)))]
    wait_futures(futures)
    return [result for f in futures for result in f.result()]


def _write_chunk(sink, chunk: _Chunk, block_bytes: int) -> tuple[int, list[list[int]]]:
    for event in chunk.events:
        event.synchronize()
    crcs = block_checksums(chunk.data, chunk.start, block_bytes)
    sink.write_at(chunk.offset, chunk.data)
    return chunk.entry, crcs


def _stored_entries(entries: list[tuple], offsets: list[int], blocks: list[list[list[int]]], base: int) -> dict:
    """The record's "stored" map: each tensor's dtype, shape, absolute byte range and sorted block checksums."""
    stored = {}
    for (name, dtype, shape, nbytes), offset, crcs in zip(entries, offsets, blocks):
        crcs.sort()
        stored[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [base + offset, base + offset + nbytes],
                        "blocks": crcs}
    return stored


def _report_failure(storage: Storage, directory: str, rank: int) -> None:
    """Tell the committing rank to give up on this step now rather than at its timeout."""
    try:
        storage.write_file(f"{directory}/{failure_file(rank)}", traceback.format_exc().encode())
    except Exception:
        pass  # the storage itself is failing; the committer's timeout still ends the step

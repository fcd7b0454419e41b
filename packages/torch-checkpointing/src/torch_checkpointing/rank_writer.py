"""One rank's part of a save: its safetensors data file, then its JSON record (the "done" marker).

The record is written only after the data file is durable, so its presence tells the committing rank
that this rank is finished, without any process-group collective. It carries the data file's size and
header checksum and the tensors' block checksums, and ends with its own (integrity.sealed_json).
"""
from __future__ import annotations

import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .file_format import (
    FORMAT, VERSION, block_checksums, data_file, dtype_name, failure_file, record_file, safetensors_header,
)
from .integrity import record_fields, sealed_json
from .layout import RankLayout
from .staging import Staged, StagingPlan
from .storage import Storage


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
) -> str:
    """Write the data file and the record; returns the record's name."""
    entries = [(p.name, dtype_name(p.dtype, p.path), p.shape, p.nbytes) for p in layout.pieces]
    entries += [(e.name, e.dtype, e.shape, e.data.nbytes) for e in extras]
    header, offsets = safetensors_header(entries, {"format": FORMAT, "rank": str(rank), "step": str(step)})
    base = len(header)
    blocks = _write_data_file(
        storage, directory, rank=rank, header=header, offsets=offsets, n_entries=len(entries), layout=layout,
        plan=plan, staged=staged, extras=extras, block_bytes=block_bytes, io_pool=io_pool,
    )
    record = {
        "format": FORMAT, "version": VERSION, "step": step, "rank": rank, "fingerprint": layout.fingerprint,
        "file": data_file(rank), **record_fields(header, base + sum(e[3] for e in entries)),
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
    layout: RankLayout,
    plan: StagingPlan,
    staged: Staged,
    extras: list[ExtraPiece],
    block_bytes: int,
    io_pool: ThreadPoolExecutor,
) -> list[list[list[int]]]:
    """Write the header, the staged segments and the extras into this rank's data file; returns each
    entry's block checksums (unsorted). On any failure the sink is aborted and the failure reported."""
    base = len(header)
    path = f"{directory}/{data_file(rank)}"
    blocks: list[list[list[int]]] = [[] for _ in range(n_entries)]
    sink = None
    try:
        sink = storage.open_sink(path)
        sink.write_at(0, memoryview(header))

        def write_segment(i: int) -> tuple[int, list[list[int]]]:
            seg = plan.segments[i]
            for event in staged.events[i]:
                event.synchronize()
            memory = staged.memory[i]
            crcs = block_checksums(memory, seg.start, block_bytes)
            sink.write_at(base + offsets[seg.piece] + seg.start, memory)
            return seg.piece, crcs

        def write_extra(j: int) -> tuple[int, list[list[int]]]:
            index = len(layout.pieces) + j
            crcs = block_checksums(extras[j].data, 0, block_bytes)
            sink.write_at(base + offsets[index], extras[j].data)
            return index, crcs

        jobs = [(write_segment, i) for i in range(len(plan.segments))] + [(write_extra, j) for j in range(len(extras))]
        if storage.parallel_writes:
            results = [f.result() for f in [io_pool.submit(fn, arg) for fn, arg in jobs]]
        else:  # in file order from this thread
            results = [fn(arg) for fn, arg in jobs]
        for index, crcs in results:
            blocks[index].extend(crcs)
        sink.finish()
    except BaseException:
        if sink is not None:
            sink.abort()
        _report_failure(storage, directory, rank)
        raise
    return blocks


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

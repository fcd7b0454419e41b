"""Loading a committed step into a given state, resharding on the way.

For every tensor the target rank holds (boxes from its own placements), each overlapping stored chunk
contributes the rows that overlap, read as byte ranges widened to whole checksum blocks so they can
be verified. When a target box is exactly a stored chunk (same layout as at save) the bytes go
straight into a contiguous CPU target, or through pinned host buffers to the GPU (device_copies.py).
Every read is one task of at most `chunk_bytes` (plus the checksum block it ends in), so the read
threads keep that many reads of each file in flight, in file order.
"""
from __future__ import annotations

import bisect
import json
import zlib
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from .device_copies import DeviceCopies
from .file_format import DTYPES, METADATA, step_dir, tensor_bytes
from .integrity import ChecksumError, read_sealed
from .layout import leaf_kind
from .sharding import Box, box_view, dtensor_boxes
from .state_tree import Leaf, decode_value
from .storage import Storage

READ_CHUNK_BYTES = 16 << 20  # one read task unless told: CheckpointerConfig.read_chunk_bytes


@dataclass(slots=True)
class Stored:
    """A tensor in a rank's data file, as its record describes it."""

    file: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of its data in the file
    nbytes: int
    block_starts: list[int]
    block_crcs: list[int]

    def covering_blocks(self, lo: int, hi: int) -> tuple[int, int, int, int]:
        """(first block, last block + 1, byte lo, byte hi) of the blocks covering [lo, hi)."""
        first = bisect.bisect_right(self.block_starts, lo) - 1
        last = bisect.bisect_left(self.block_starts, hi)
        end = self.block_starts[last] if last < len(self.block_starts) else self.nbytes
        return first, last, self.block_starts[first], end


class StepReader:
    def __init__(self, storage: Storage, step: int, *, verify: bool, io_pool: ThreadPoolExecutor, world_size: int,
                 chunk_bytes: int = READ_CHUNK_BYTES):
        self.storage, self.step, self.verify, self.io_pool = storage, step, verify, io_pool
        self.chunk_bytes = chunk_bytes
        # two pinned buffers per read thread: one being read into while the other's copy runs
        self.copies = DeviceCopies(chunk_bytes, 2 * io_pool._max_workers)  # (the pool's size, not kept elsewhere)
        self.world_size_now = world_size
        self.directory = step_dir(step)
        self.metadata = read_sealed(storage, f"{self.directory}/{METADATA}")
        self.world_size: int = self.metadata["world_size"]
        self._records: dict[int, dict] = {}

    def record(self, rank: int) -> dict:
        if rank not in self._records:
            name = self.metadata["records"][rank]
            self._records[rank] = read_sealed(self.storage, f"{self.directory}/{name}")
        return self._records[rank]

    def stored(self, rank: int, name: str) -> Stored:
        record = self.record(rank)
        entry = record["stored"][name]
        blocks = entry["blocks"]
        start, end = entry["data_offsets"]
        return Stored(
            file=f"{self.directory}/{record['file']}", name=name, dtype=DTYPES[entry["dtype"]],
            shape=tuple(entry["shape"]), start=start, nbytes=end - start,
            block_starts=[b[0] for b in blocks] or [0], block_crcs=[b[1] for b in blocks],
        )

    # ---- reading bytes ---------------------------------------------------------------------

    def read_verified(self, stored: Stored, path: str, lo: int, hi: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """Bytes [lo, hi) of a stored tensor, verified: (uint8 buffer, tensor byte offset of buffer[0]).

        Reads widen to whole checksum blocks; with `out` (a contiguous uint8 CPU tensor of exactly
        hi - lo bytes, block-aligned) the bytes land in it directly.
        """
        if self.verify and stored.nbytes:
            first, last, lo, hi = stored.covering_blocks(lo, hi)
        if out is None:
            out = torch.empty(hi - lo, dtype=torch.uint8)
        assert out.numel() == hi - lo, "direct reads must be block-aligned"
        data = tensor_bytes(out)
        where = f"bytes [{stored.start + lo}, {stored.start + hi}) of {self.storage.describe(stored.file)}"
        try:
            self.storage.read_into(stored.file, stored.start + lo, data)
        except (EOFError, FileNotFoundError) as e:  # find_damage checks this first; a file may change since
            raise ChecksumError(f"{where} (tensor {stored.name!r}, state {path!r}) could not be read, "
                                f"the file is damaged: {e}") from None
        except OSError as e:  # the disk's error (EIO, ...), said with what was being read
            raise OSError(e.errno, f"reading {where} (tensor {stored.name!r}, state {path!r}) failed: {e}") from e
        if self.verify and stored.nbytes:
            for b in range(first, last):
                b_lo = stored.block_starts[b]
                b_hi = stored.block_starts[b + 1] if b + 1 < len(stored.block_starts) else stored.nbytes
                if zlib.crc32(data[b_lo - lo:b_hi - lo]) != stored.block_crcs[b]:
                    raise ChecksumError(
                        f"{self.storage.describe(stored.file)}: tensor {stored.name!r} (state {path!r}) is damaged: "
                        f"bytes [{b_lo}, {b_hi}) of its data do not match the checksum written at save time"
                    )
        return out, lo

    def read_tensor(self, rank: int, name: str, path: str) -> torch.Tensor:
        """A whole stored tensor on CPU."""
        stored = self.stored(rank, name)
        data, _ = self.read_verified(stored, path, 0, stored.nbytes)
        return data.view(stored.dtype).reshape(stored.shape)

    # ---- planning a load -------------------------------------------------------------------

    def tensor_tasks(self, path: str, target: torch.Tensor) -> list[Callable[[], None]]:
        """Read tasks that together fill this rank's part of `target` (a tensor or DTensor)."""
        entry = self.metadata["tensors"].get(path)
        assert entry is not None
        global_shape = tuple(entry["shape"])
        if tuple(target.shape) != global_shape:
            raise ValueError(f"{path!r} has global shape {tuple(target.shape)} here but {global_shape} in step {self.step}")
        if isinstance(target, DTensor):
            boxes, _ = dtensor_boxes(path, target)
            local = target._local_tensor
        else:
            boxes = [Box((0,) * target.dim(), tuple(target.shape), (0,) * target.dim())] if target.numel() else []
            local = target
        tasks = []
        for box in boxes:
            view = box_view(path, local, box)  # detached: parameters may require grad; we fill their storage
            for chunk in entry["chunks"]:
                tasks += self._chunk_tasks(path, view, box, chunk)
        return tasks

    def _chunk_tasks(self, path: str, view: torch.Tensor, box: Box, chunk: dict) -> list[Callable[[], None]]:
        """Tasks filling the part of `view` (the target's elements of `box`) that `chunk` stores."""
        c_off, c_shape = tuple(chunk["offset"]), tuple(chunk["shape"])
        lo = [max(b, c) for b, c in zip(box.offset, c_off)]
        hi = [min(b + bs, c + cs) for b, bs, c, cs in zip(box.offset, box.shape, c_off, c_shape)]
        if any(l >= h for l, h in zip(lo, hi)):
            return []
        stored = self.stored(chunk["rank"], chunk["name"])
        # the overlap in the stored chunk's coordinates and in the box's
        in_chunk = [slice(l - c, h - c) for l, h, c in zip(lo, hi, c_off)]
        in_box = [slice(l - b, h - b) for l, h, b in zip(lo, hi, box.offset)]
        dst = view[tuple(in_box)]
        es = stored.dtype.itemsize
        exact = tuple(lo) == c_off and tuple(h - l for l, h in zip(lo, hi)) == c_shape
        if exact and dst.is_contiguous() and dst.dtype == stored.dtype:
            return self._exact_tasks(path, stored, dst)
        if view.dim() == 0:
            return [lambda: dst.copy_(self.read_tensor(chunk["rank"], chunk["name"], path).reshape(()))]
        row_bytes = es
        for s in c_shape[1:]:
            row_bytes *= s
        rows_per = max(1, self.chunk_bytes // max(row_bytes, 1))
        tasks = []
        r_start, r_stop = in_chunk[0].start, in_chunk[0].stop
        for r0 in range(r_start, r_stop, rows_per):
            r1 = min(r_stop, r0 + rows_per)
            tasks.append(self._rows_task(path, stored, dst[r0 - r_start:r1 - r_start], r0, r1, row_bytes, in_chunk[1:]))
        return tasks

    def _rows_task(self, path, stored: Stored, dst: torch.Tensor, r0: int, r1: int, row_bytes: int, inner: list[slice]):
        def run() -> None:
            data, base = self.read_verified(stored, path, r0 * row_bytes, r1 * row_bytes)
            rows = data[r0 * row_bytes - base:r1 * row_bytes - base]
            src = rows.view(stored.dtype).view((r1 - r0, *stored.shape[1:]))
            self.copies.copy(dst, src[(slice(None), *inner)])
        return run

    def _exact_tasks(self, path: str, stored: Stored, dst: torch.Tensor) -> list[Callable[[], None]]:
        """Same layout as saved: the stored bytes as they are, in chunks cut at checksum blocks; straight
        into a CPU target, through a pinned buffer to a GPU one."""
        flat = dst.reshape(-1).view(torch.uint8)
        tasks = []
        for lo, hi in self.chunks(stored):
            if flat.device.type == "cpu":
                def run(lo: int = lo, hi: int = hi) -> None:
                    self.read_verified(stored, path, lo, hi, out=flat[lo:hi])
            else:
                def run(lo: int = lo, hi: int = hi) -> None:
                    self.copies.to_device(flat[lo:hi], lambda host: self.read_verified(stored, path, lo, hi, out=host),
                                          stored.start + lo)
            tasks.append(run)
        return tasks

    def chunks(self, stored: Stored) -> list[tuple[int, int]]:
        """[lo, hi) byte ranges of about chunk_bytes covering the tensor; cut at checksum blocks when
        verifying (a chunk is then at most chunk_bytes + one block, and at least one block)."""
        step = self.chunk_bytes
        starts = stored.block_starts[1:] if self.verify else range(step, stored.nbytes, step)
        cuts = [0]
        for start in starts:
            if start - cuts[-1] >= step:
                cuts.append(start)
        cuts.append(stored.nbytes)
        return [(lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:]) if hi > lo]

    # ---- per-rank entries ------------------------------------------------------------------

    def rank_entry(self, path: str, rank: int) -> tuple[int, dict]:
        """(saved rank to read, its entry) for a per-rank path: this rank's own when the world size is
        unchanged, otherwise the common one when every saved rank stored the same thing."""
        if self.world_size == self.world_size_now:
            return rank, self.record(rank)["values"][path]
        entries = [self.record(r)["values"][path] for r in range(self.world_size)]
        signatures = [self._signature(r, e) for r, e in enumerate(entries)]
        if any(s != signatures[0] for s in signatures):
            raise ValueError(
                f"{path!r} is stored per rank and differs between the {self.world_size} saved ranks, so it has no "
                f"meaning on {self.world_size_now} ranks; load with a state that leaves {path!r} out, or resume "
                f"on {self.world_size} ranks"
            )
        return 0, entries[0]

    def _signature(self, rank: int, entry: dict) -> Any:
        if "value" in entry:
            return json.dumps(entry["value"], sort_keys=True)
        name = entry.get("tensor", entry.get("bytes"))
        stored = self.record(rank)["stored"][name]
        return (stored["dtype"], stored["shape"], [c for _, c in stored["blocks"]])


def load_step(reader: StepReader, leaves: list[Leaf], *, per_rank: tuple[str, ...], rank: int) -> None:
    """Fill every leaf from the step; raises before reading anything if keys or shapes do not fit."""
    meta_tensors, meta_per_rank = reader.metadata["tensors"], set(reader.metadata["per_rank"])
    missing, tasks, assignments = [], [], []
    for leaf in leaves:
        kind = leaf_kind(leaf, per_rank)
        is_tensor = kind in ("dtensor", "tensor")
        if leaf.path in (meta_per_rank if is_tensor else meta_tensors):
            raise ValueError(
                f"{leaf.path!r} is {'stored per rank' if is_tensor else 'a sharded/replicated tensor'} in step "
                f"{reader.step} but {'a tensor' if is_tensor else 'a per-rank entry'} in the state being loaded; "
                "check the per_rank setting"
            )
        if leaf.path not in (meta_tensors if is_tensor else meta_per_rank):
            missing.append(leaf.path)
        elif is_tensor:
            tasks += reader.tensor_tasks(leaf.path, leaf.value)
        else:
            assignments.append(leaf)
    if missing:
        available = sorted(meta_tensors) + sorted(meta_per_rank)
        raise ValueError(
            f"step {reader.step} has no entry for {len(missing)} state key(s): {missing[:10]}; "
            f"it holds {len(available)} entries, e.g. {available[:10]}"
        )
    reader.copies.prepare({_local(leaf.value).device for leaf in leaves if isinstance(leaf.value, torch.Tensor)})
    run_tasks(reader, tasks)
    for leaf in assignments:
        source_rank, entry = reader.rank_entry(leaf.path, rank)
        if "value" in entry:
            leaf.parent[leaf.key] = decode_value(entry["value"])
        elif "bytes" in entry:
            leaf.parent[leaf.key] = _as_bytes(reader.read_tensor(source_rank, entry["bytes"], leaf.path))
        else:
            loaded = reader.read_tensor(source_rank, entry["tensor"], leaf.path)
            target = leaf.value
            if isinstance(target, torch.Tensor) and target.shape == loaded.shape:
                target.detach().copy_(loaded)
            else:  # a per-rank tensor whose size changed (or a value became a tensor): replace it
                device = target.device if isinstance(target, torch.Tensor) else "cpu"
                leaf.parent[leaf.key] = loaded.to(device)


def run_tasks(reader: StepReader, tasks: list[Callable[[], None]]) -> None:
    """Run read tasks on the read threads, in order; on the first failure the tasks not started are
    dropped and the running ones waited for (none writes into a target after this returns), then it raises."""
    futures = [reader.io_pool.submit(task) for task in tasks]
    try:
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            for future in futures:
                future.cancel()
            wait(futures)
            # the first failure in file order (a cut file: the read that reaches its end)
            next(f for f in futures if not f.cancelled() and f.exception() is not None).result()
    finally:
        reader.copies.finish()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _as_bytes(t: torch.Tensor) -> bytes:
    return bytes(tensor_bytes(t.contiguous())) if t.numel() else b""

"""The rank writer's data path: chunks taken in file order by several threads, CPU staging copies that
overlap the writes, and failures in either that leave no step (and no write after the file is closed)."""
from __future__ import annotations

import errno
import json
import threading
import time
import zlib

import pytest
import torch

import torch_checkpointing as tc
from torch_checkpointing import rank_writer, staging

SLAB, BLOCK = 64 << 10, 4096


def make_state(value: float = 0.0) -> dict:
    """A few hundred KB over several slabs: contiguous tensors of two dtypes, a strided view (row copies)."""
    wide = torch.arange(96 * 700, dtype=torch.float32).reshape(96, 700) + value
    return {"a": torch.arange(40_000, dtype=torch.float32) + value,
            "b": (torch.arange(30_000, dtype=torch.float32) + value).to(torch.bfloat16),
            "t": wide.t(), "step": 1}


class LoggingStorage(tc.LocalStorage):
    """Local storage that logs every data write as (offset, bytes, after the sink was closed?)."""

    def __init__(self, root, *, fail_at: int | None = None, delay_s: float = 0.0):
        super().__init__(root, fsync=False)
        self.writes: list[tuple[int, int, bool]] = []
        self.threads: list[int] = []  # the thread of each write
        self.fail_at, self.delay_s = fail_at, delay_s
        self.lock = threading.Lock()

    def open_sink(self, path):
        sink = super().open_sink(path)
        write_at, finish, abort = sink.write_at, sink.finish, sink.abort
        closed = threading.Event()

        def logged(offset, data):
            with self.lock:
                self.writes.append((offset, len(data), closed.is_set()))
                self.threads.append(threading.get_ident())
                n = len(self.writes)
            if self.fail_at is not None and n == self.fail_at:
                raise OSError(errno.ENOSPC, "ENOSPC (injected)")
            time.sleep(self.delay_s)
            write_at(offset, data)

        def close(fn):
            def closing():
                closed.set()
                fn()
            return closing
        sink.write_at, sink.finish, sink.abort = logged, close(finish), close(abort)
        return sink


def test_chunks_are_taken_in_file_order_and_checksummed_as_whole_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_writer, "WRITE_CHUNK_BYTES", 2 * BLOCK)  # many chunks per segment
    storage = LoggingStorage(tmp_path, delay_s=0.001)
    state = make_state(1.0)
    with tc.Checkpointer(storage, slab_bytes=SLAB, block_bytes=BLOCK, io_threads=4) as ckpt:
        ckpt.save(1, state, blocking=True)
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
        ckpt.load(target, step=1)  # verify=True: every block checksum is checked
    for k in ("a", "b", "t"):
        assert torch.equal(target[k], state[k])
    data = [(o, n, t) for (o, n, _), t in zip(storage.writes, storage.threads) if o > 0]
    assert len(data) > 20 and all(n <= 2 * BLOCK for _, n, _ in data)
    assert len({t for _, _, t in data}) > 1  # written by several threads
    for thread in {t for _, _, t in data}:  # each takes the next chunk from one queue in file order
        mine = [o for o, _, t in data if t == thread]
        assert mine == sorted(mine)
    assert sorted(o for o, _, _ in data) == sorted(set(o for o, _, _ in data))  # each chunk written once
    # the blocks are the tensor's own 4 KiB blocks (offsets from the tensor's start), whatever the chunking
    record = next(p for p in (tmp_path / "step-1").iterdir() if p.name.startswith("rank-") and p.suffix == ".json")
    stored = json.loads(record.read_bytes())["stored"]
    raw = (tmp_path / "step-1" / "rank-00000.safetensors").read_bytes()
    lo, hi = stored["a"]["data_offsets"]
    assert [b[0] for b in stored["a"]["blocks"]] == list(range(0, hi - lo, BLOCK))
    assert [b[1] for b in stored["a"]["blocks"]] == [zlib.crc32(raw[lo + s:min(hi, lo + s + BLOCK)])
                                                     for s in range(0, hi - lo, BLOCK)]


def test_a_failing_write_stops_every_thread_before_the_file_is_closed(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_writer, "WRITE_CHUNK_BYTES", BLOCK)
    storage = LoggingStorage(tmp_path, fail_at=6, delay_s=0.002)
    with tc.Checkpointer(storage, slab_bytes=SLAB, block_bytes=BLOCK, io_threads=4) as ckpt:
        with pytest.raises((OSError, tc.CommitError), match="ENOSPC"):
            ckpt.save(1, make_state(), blocking=True)
        assert not any(after_close for _, _, after_close in storage.writes)  # no pwrite into a closed (reused) fd
        assert len(storage.writes) < 6 + 4  # the other threads stopped at their next chunk
        assert ckpt.steps() == [] and not (tmp_path / ".tmp-step-1").exists()
        storage.fail_at = None
        ckpt.save(2, make_state(2.0), blocking=True)
        assert ckpt.steps() == [2]


def test_cpu_staging_copies_overlap_the_writes(tmp_path, monkeypatch):
    """A non-blocking CPU save: the writer writes the first slabs while the later ones are still being
    copied; save() returns after the last copy, and changing the state then changes nothing saved."""
    events: list[str] = []
    copy = staging._copy_segment

    def slow_copy(*args, **kwargs):
        time.sleep(0.01)  # room for the writer to start
        copy(*args, **kwargs)
        events.append("copy")

    monkeypatch.setattr(staging, "_copy_segment", slow_copy)
    storage = LoggingStorage(tmp_path)
    sink_write = storage.open_sink

    def open_sink(path):
        sink = sink_write(path)
        write_at = sink.write_at

        def noted(offset, data):
            if offset > 0:
                events.append("write")
            write_at(offset, data)
        sink.write_at = noted
        return sink
    storage.open_sink = open_sink
    state = make_state(3.0)
    with tc.Checkpointer(storage, slab_bytes=SLAB, block_bytes=BLOCK, io_threads=2) as ckpt:
        handle = ckpt.save(1, state)
        assert events.count("copy") > 3  # every copy is done when save() returns: several slabs
        saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        for k in ("a", "b", "t"):
            state[k].add_(100)  # after save() returned: not in the checkpoint
        handle.wait()
        last_copy = max(i for i, e in enumerate(events) if e == "copy")
        assert "write" in events[:last_copy], events  # a write before the last copy: they overlapped
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
        ckpt.load(target, step=1)
    for k in ("a", "b", "t"):
        assert torch.equal(target[k], saved[k])


def test_a_failing_cpu_staging_copy_fails_the_save_and_leaves_no_step(tmp_path, monkeypatch):
    calls = {"n": 0}
    copy = staging._copy_segment

    def failing_copy(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("copy failed (injected)")
        copy(*args, **kwargs)

    with tc.Checkpointer(LoggingStorage(tmp_path), slab_bytes=SLAB, block_bytes=BLOCK, io_threads=2) as ckpt:
        ckpt.save(1, make_state(1.0), blocking=True)
        monkeypatch.setattr(staging, "_copy_segment", failing_copy)
        with pytest.raises(RuntimeError, match="copy failed"):
            ckpt.save(2, make_state(2.0))
        assert ckpt.steps() == [1] and not (tmp_path / ".tmp-step-2").exists()
        monkeypatch.setattr(staging, "_copy_segment", copy)
        ckpt.save(3, make_state(3.0)).wait()
        assert ckpt.steps() == [1, 3]
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in make_state().items()}
        ckpt.load(target, step=3)
    assert torch.equal(target["t"], make_state(3.0)["t"])

"""Parallel loads: every read thread count gives the saved bits, the threads really read at once (counted
in the storage, not timed), a file cut or damaged under a parallel load still names the file and range."""
from __future__ import annotations

import threading

import pytest
import torch

import torch_checkpointing as tc

BLOCK, CHUNK = 4096, 16384  # small blocks and chunks: the tensors below span many chunks


class WatchedStorage(tc.LocalStorage):
    """Local storage that records every data read (offset, bytes) and how many ran at once. With
    `meet` > 1, the first `meet` data reads wait for each other (a barrier, timing out after 30 s), so a
    pool that reads one chunk at a time never gets more than 1 read in flight and fails the count."""

    def __init__(self, root, meet: int = 1):
        super().__init__(root, fsync=False)
        self.lock = threading.Lock()
        self.reads: list[tuple[str, int, int]] = []
        self.active = self.most_active = 0
        self.meet = threading.Barrier(meet, timeout=30) if meet > 1 else None
        self.waiting = meet

    def read_into(self, path, offset, out):
        if offset == 0:  # the data file's header, checked before a load
            return super().read_into(path, offset, out)
        with self.lock:
            self.reads.append((path, offset, out.nbytes))
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            meet = self.meet is not None and self.waiting > 0
            self.waiting -= meet
        try:
            if meet:
                try:
                    self.meet.wait()
                except threading.BrokenBarrierError:  # too few reads at once: the count below shows it
                    pass
            super().read_into(path, offset, out)
        finally:
            with self.lock:
                self.active -= 1


def mixed_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(10 * CHUNK // 4, generator=g),  # exactly 10 chunks
        "odd": torch.randn(3 * CHUNK // 8 + 37, 2, generator=g, dtype=torch.float64),  # not a chunk or block multiple
        "bf16": torch.randn(999, 17, generator=g).bfloat16(),
        "half": torch.randn(5000, generator=g).half(),
        "ints": torch.randint(-2**40, 2**40, (3001,), generator=g),
        "bytes": torch.randint(0, 256, (12345,), generator=g, dtype=torch.uint8),
        "mask": torch.rand(7777, generator=g) > 0.5,
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(2.5),
        "step": 7,
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def zeros_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("verify", [True, False])
def test_every_thread_count_loads_the_saved_bits(tmp_path, threads, verify):
    state = mixed_state()
    storage = WatchedStorage(tmp_path)
    with tc.Checkpointer(storage, block_bytes=BLOCK, read_threads=threads, read_chunk_bytes=CHUNK,
                         verify=verify) as ckpt:
        ckpt.save(1, state, blocking=True)
        target = zeros_like(state)
        assert ckpt.load(target) == 1
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert target[k].dtype == v.dtype and target[k].shape == v.shape
            assert torch.equal(bits(target[k]), bits(v)), k
        else:
            assert target[k] == v
    sizes = [n for _, _, n in storage.reads]
    assert max(sizes) <= CHUNK  # chunked: no read larger than a chunk (blocks divide chunks here)
    big = [n for _, off, n in storage.reads if n == CHUNK]
    assert len(big) >= 10  # "big" alone is 10 whole chunks
    total = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    assert sum(sizes) == total  # each byte read once


def test_one_thread_reads_each_file_in_order(tmp_path):
    state = mixed_state()
    storage = WatchedStorage(tmp_path)
    with tc.Checkpointer(storage, block_bytes=BLOCK, read_threads=1, read_chunk_bytes=CHUNK) as ckpt:
        ckpt.save(1, state, blocking=True)
        storage.reads.clear()
        ckpt.load(zeros_like(state))
    offsets = [off for _, off, _ in storage.reads]
    assert storage.most_active == 1 and len(offsets) > 10
    assert offsets == sorted(offsets)


def test_the_read_threads_read_at_once(tmp_path):
    state = {"big": torch.randn(10 * CHUNK // 4), "other": torch.randn(3 * CHUNK // 4)}
    with tc.Checkpointer(tc.LocalStorage(tmp_path, fsync=False), block_bytes=BLOCK) as ckpt:
        ckpt.save(1, state, blocking=True)
    storage = WatchedStorage(tmp_path, meet=4)
    target = zeros_like(state)
    with tc.Checkpointer(storage, read_threads=4, read_chunk_bytes=CHUNK) as ckpt:
        ckpt.load(target)
    assert storage.most_active == 4  # the first four reads were all in flight together
    assert storage.meet.broken is False
    assert len(storage.reads) == 13
    assert all(torch.equal(target[k], state[k]) for k in state)


class LyingSizeStorage(WatchedStorage):
    """A data file cut after the check before the load: the size check is told the written size."""

    def __init__(self, root, sizes: dict[str, int]):
        super().__init__(root)
        self.sizes = sizes

    def size(self, path):
        return self.sizes.get(path) or super().size(path)


def test_a_file_cut_during_a_parallel_load_names_the_file_and_range(tmp_path):
    state = {"a": torch.randn(4 * CHUNK // 4), "b": torch.randn(6 * CHUNK // 4)}
    with tc.Checkpointer(tc.LocalStorage(tmp_path, fsync=False), block_bytes=BLOCK) as ckpt:
        ckpt.save(1, state, blocking=True)
    data = tmp_path / "step-1" / "rank-00000.safetensors"
    written = data.stat().st_size
    cut = written - 2 * CHUNK - 100  # inside the last chunk but two of "b"
    with open(data, "r+b") as f:
        f.truncate(cut)
    storage = LyingSizeStorage(tmp_path, {"step-1/rank-00000.safetensors": written})
    with tc.Checkpointer(storage, read_threads=4, read_chunk_bytes=CHUNK) as ckpt:
        with pytest.raises(tc.ChecksumError, match=(
                r"bytes \[\d+, \d+\) of \S+step-1/rank-00000\.safetensors \(tensor 'b', state 'b'\) could not be "
                rf"read, the file is damaged: \S+ ends at byte {cut}, before the end of the range \[\d+, \d+\) read")):
            ckpt.load(zeros_like(state), step=1)
    assert storage.active == 0  # no read still running once the load has raised


def test_a_flipped_bit_in_a_late_chunk_is_found_by_a_parallel_load(tmp_path):
    state = {"a": torch.randn(8 * CHUNK // 4)}
    with tc.Checkpointer(tc.LocalStorage(tmp_path, fsync=False), block_bytes=BLOCK) as ckpt:
        ckpt.save(1, state, blocking=True)
    data = tmp_path / "step-1" / "rank-00000.safetensors"
    raw = bytearray(data.read_bytes())
    header = len(raw) - 8 * CHUNK
    raw[header + 6 * CHUNK + 5000] ^= 1
    data.write_bytes(bytes(raw))
    lo = 6 * CHUNK + BLOCK
    with tc.Checkpointer(tmp_path, read_threads=4, read_chunk_bytes=CHUNK) as ckpt:
        with pytest.raises(tc.ChecksumError, match=rf"tensor 'a' .*bytes \[{lo}, {lo + BLOCK}\) of its data"):
            ckpt.load({"a": torch.zeros_like(state["a"])}, step=1)


@pytest.mark.parametrize("field, value", [("read_threads", 0), ("read_threads", 1.5), ("read_chunk_bytes", 5000),
                                          ("read_chunk_bytes", 2048)])
def test_read_settings_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        tc.CheckpointerConfig(**{field: value})

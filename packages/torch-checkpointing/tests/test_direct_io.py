"""Direct I/O in LocalStorage: the page-aligned parts of a data file go past the page cache, the rest
buffered, and the file comes out byte for byte as the buffered writer makes it (odd-sized tensors that
shift later ones off the page grid included); a filesystem that refuses O_DIRECT gets buffered writes."""
from __future__ import annotations

import errno
import os
import random

import pytest
import torch

import torch_checkpointing as tc
from torch_checkpointing import staging, storage
from torch_checkpointing.file_format import data_file, step_dir
from torch_checkpointing.layout import Piece

SLAB, BLOCK = 64 << 10, 4096


def odd_state() -> dict:
    """Tensors whose byte sizes are not page multiples (each shifts the next off the page grid), a
    strided view (row copies), a bf16 tensor and a scalar, over several slabs."""
    gen = torch.Generator().manual_seed(7)
    return {"a": torch.randn(40_001, generator=gen),  # 160,004 bytes
            "s": torch.tensor(3.5),
            "b": torch.randn(30_003, generator=gen).to(torch.bfloat16),
            "t": torch.randn(96, 701, generator=gen).t(),
            "c": torch.randn(50_000, generator=gen), "step": 1}


def direct_supported(path) -> bool:
    try:
        fd = os.open(path / "probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(path / "probe")
    return hasattr(os, "O_DIRECT")


def count_writes(monkeypatch) -> dict:
    counts = {"direct": 0, "buffered": 0}
    real_direct, real_buffered = storage._LocalSink._direct, storage._LocalSink._buffered

    def direct(self, offset, data):
        counts["direct"] += len(data)
        return real_direct(self, offset, data)

    def buffered(self, offset, data):
        counts["buffered"] += len(data)
        return real_buffered(self, offset, data)

    monkeypatch.setattr(storage._LocalSink, "_direct", direct)
    monkeypatch.setattr(storage._LocalSink, "_buffered", buffered)
    return counts


def save_file(root, direct_io: bool, state: dict, *, blocking: bool = False) -> bytes:
    with tc.Checkpointer(tc.LocalStorage(root, direct_io=direct_io), slab_bytes=SLAB, block_bytes=BLOCK,
                         io_threads=3) as ckpt:
        ckpt.save(1, state, blocking=blocking).wait()
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
        ckpt.load(target)
    for k, v in state.items():
        assert torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v, k
    return (root / step_dir(1) / data_file(0)).read_bytes()


def test_direct_file_matches_the_buffered_one_and_most_bytes_go_direct(tmp_path, monkeypatch):
    if not direct_supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    state = odd_state()
    reference = save_file(tmp_path / "buffered", False, state)
    counts = count_writes(monkeypatch)
    assert save_file(tmp_path / "direct", True, state) == reference
    # every page of the shifted tensors too, but their first and last partial pages; "t" (a strided copy)
    # lands 2926 bytes past a page, which its fp32 rows cannot be staged at: it goes buffered
    assert counts["direct"] >= 0.9 * (len(reference) - state["t"].numel() * 4), counts
    assert counts["direct"] % storage.DIRECT_ALIGNMENT == 0


def test_blocking_save_from_unaligned_state_memory_is_correct(tmp_path):
    state = odd_state()  # written from the state itself (no staging copy): whatever its alignment
    assert save_file(tmp_path / "direct", True, state, blocking=True) == save_file(tmp_path / "buffered", False, state)


@pytest.mark.parametrize("error", [errno.EINVAL, errno.EFAULT])  # EFAULT: host memory the kernel cannot pin
def test_a_refused_direct_write_falls_back_to_buffered(tmp_path, monkeypatch, error):
    state = odd_state()
    reference = save_file(tmp_path / "buffered", False, state)
    real_pwrite, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        if fd in direct_fds:  # the O_DIRECT descriptor: as a filesystem that refuses it
            refused.append(offset)
            raise OSError(error, os.strerror(error))
        return real_pwrite(fd, data, offset)

    direct_fds: set[int] = set()
    real_init = storage._LocalSink.__init__

    def init(self, *args):
        real_init(self, *args)
        if self.direct_fd is None:  # O_DIRECT refused at open: stand in with a plain descriptor
            self.direct_fd = os.open(self.path, os.O_WRONLY)
        direct_fds.add(self.direct_fd)

    monkeypatch.setattr(storage._LocalSink, "__init__", init)
    monkeypatch.setattr(os, "pwrite", pwrite)
    assert save_file(tmp_path / "direct", True, state) == reference
    assert 1 <= len(refused) <= 3  # the first refusal turns the sink to buffered writes (3 I/O threads)


def test_a_filesystem_refusing_o_direct_at_open_is_written_buffered(tmp_path, monkeypatch):
    state = odd_state()
    reference = save_file(tmp_path / "buffered", False, state)
    real_open = os.open

    def open_(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_)
    counts = count_writes(monkeypatch)
    assert save_file(tmp_path / "direct", True, state) == reference
    assert counts["direct"] == 0


def test_direct_io_setting_is_checked():
    with pytest.raises(TypeError, match="direct_io"):
        tc.LocalStorage("/tmp/x", direct_io="yes")
    assert tc.LocalStorage("/tmp/x").direct_io is False  # buffered unless asked: faster on the H200 host
    assert tc.LocalStorage("/tmp/x", direct_io=True).direct_io is True


def test_staged_segments_sit_at_their_file_offset_modulo_a_page():
    rng = random.Random(3)
    for _ in range(50):
        sizes = [rng.choice([1, 3, 4096, 5000, 65_536, 100_003, 200_000]) * rng.choice([1, 2, 4]) for _ in range(8)]
        pieces = [Piece(f"p{i}", f"p{i}", i, None, torch.uint8, (n,), n) for i, n in enumerate(sizes)]
        plan = staging.plan_staging(pieces, [torch.empty(n, dtype=torch.uint8) for n in sizes],
                                    slab_bytes=SLAB, block_bytes=BLOCK)
        file_offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        covered = {i: 0 for i in range(len(sizes))}
        last_end: dict[int, int] = {}
        for seg in plan.segments:
            assert seg.start % BLOCK == 0 and seg.start == covered[seg.piece]  # block-aligned cuts, in order
            covered[seg.piece] += seg.nbytes
            assert seg.slab_offset + seg.nbytes <= plan.slab_bytes
            assert seg.slab_offset >= last_end.get(seg.slab, 0)  # no overlap within a slab
            last_end[seg.slab] = seg.slab_offset + seg.nbytes
            assert seg.slab_offset % 4096 == (file_offsets[seg.piece] + seg.start) % 4096
        assert covered == dict(enumerate(sizes))


def test_other_direct_write_errors_fail_the_save(tmp_path, monkeypatch):
    """A full disk is not a refusal: the save fails (and leaves no step), as a buffered one would."""
    real_init, real_pwrite = storage._LocalSink.__init__, os.pwrite
    direct_fds: set[int] = set()

    def init(self, *args):
        real_init(self, *args)
        if self.direct_fd is None:
            self.direct_fd = os.open(self.path, os.O_WRONLY)
        direct_fds.add(self.direct_fd)

    def pwrite(fd, data, offset):
        if fd in direct_fds:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(storage._LocalSink, "__init__", init)
    monkeypatch.setattr(os, "pwrite", pwrite)
    with tc.Checkpointer(tc.LocalStorage(tmp_path, direct_io=True), slab_bytes=SLAB, block_bytes=BLOCK) as ckpt:
        with pytest.raises(Exception, match="No space left"):
            ckpt.save(1, odd_state()).wait()
        assert ckpt.steps() == []


def test_direct_reads_give_the_file_bytes_and_fall_back_where_unaligned(tmp_path, monkeypatch):
    import mmap

    data = random.Random(5).randbytes(5 * 4096 + 123)
    (tmp_path / "f").write_bytes(data)
    direct_bytes = []
    real = tc.LocalStorage._read_direct

    def counting(self, path, offset, out):
        done = real(self, path, offset, out)
        direct_bytes.append(done)
        return done

    monkeypatch.setattr(tc.LocalStorage, "_read_direct", counting)
    store = tc.LocalStorage(tmp_path, direct_io=True, fsync=False)
    memory = mmap.mmap(-1, 8 * 4096)  # page-aligned, as a GPU load's pinned buffers are placed
    view = memoryview(memory)
    # (file offset, length, where in the buffer): aligned; unaligned head and tail at the same page offset;
    # to the end of the file; memory off the file's page grid (buffered only)
    cases = [(0, 3 * 4096, 0), (100, 3 * 4096 + 7, 100), (4 * 4096, 4096 + 123, 0), (100, 9000, 0)]
    for offset, length, at in cases:
        out = view[at:at + length]
        store.read_into("f", offset, out)
        assert bytes(out) == data[offset:offset + length], (offset, length, at)
    with pytest.raises(EOFError, match=rf"ends at byte {len(data)}, before the end of the range \[\d+, {4 * 4096 + 2 * 4096}\) read"):
        store.read_into("f", 4 * 4096, view[:2 * 4096])  # past the end: said where the file ends
    if direct_supported(tmp_path):
        # the buffer off the page grid made no direct read; the read past the end got its whole pages direct
        assert direct_bytes == [3 * 4096, 2 * 4096, 4096, 4096]
    else:  # refused: every read was buffered, and said so once
        assert sum(direct_bytes) == 0
    direct_bytes.clear()  # direct reads on their own, and off for a direct writer
    tc.LocalStorage(tmp_path, direct_reads=True).read_into("f", 0, view[:4096])
    tc.LocalStorage(tmp_path, direct_io=True, direct_reads=False).read_into("f", 0, view[:4096])
    assert len(direct_bytes) == 1
    with pytest.raises(TypeError, match="direct_reads"):
        tc.LocalStorage(tmp_path, direct_reads="yes")

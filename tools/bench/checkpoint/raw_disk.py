"""What the disk itself does: the same bytes a save writes, with plain writes and fsync.

The write figure of a save path (save until durable) means little alone: on a disk that writes 1 GB/s
no writer saves 8 GB in under 8 s. This writes the rank's bytes sequentially, in 4 MiB writes (what
torch-checkpointing's writer issues) from a buffer of random bytes, into one file per thread, then
fsyncs each file: buffered with 1 thread (the disk's single-stream speed through the page cache) and
with the writer's thread count (parallel streams), and with O_DIRECT (page-aligned buffer, files
preallocated, past the page cache: what torch-checkpointing's writer does with direct I/O) with the
writer's thread count. Each rank writes its own files at the same time, as the save paths do.

For a cold load, the read ceiling: one file of the rank's bytes, evicted from the page cache, read whole
in 16 MiB reads that `threads` threads take in file order from one queue (what a torch-checkpointing
load issues): buffered with 1 thread and with the reader's thread count, and with O_DIRECT.
"""
from __future__ import annotations

import mmap
import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHUNK = 4 << 20
READ_CHUNK = 16 << 20
PAGE = 4096


def _write_file(path: Path, nbytes: int, buffer: memoryview, direct: bool) -> None:
    if direct:  # whole pages only: the last one is padded (the file is a few bytes longer at most)
        nbytes = -(-nbytes // PAGE) * PAGE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        if direct and nbytes:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError:
                pass
        written = 0
        while written < nbytes:
            written += os.pwrite(fd, buffer[: min(CHUNK, nbytes - written)], written)
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write_s(root: Path, nbytes: int, threads: int, *, direct: bool = False) -> float:
    """Seconds to write `nbytes` in all, split over `threads` files written in parallel, until durable."""
    root.mkdir(parents=True, exist_ok=True)
    memory = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    memory.write(os.urandom(CHUNK))  # random: a compressing filesystem is not flattered
    buffer = memoryview(memory)
    share = -(-nbytes // threads)
    paths = [root / f"raw-{i}.bin" for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:  # started before the clock: thread start-up is not the disk's
        pool.map(lambda _: None, range(threads))
        began = time.perf_counter()
        for f in [pool.submit(_write_file, p, max(0, min(share, nbytes - i * share)), buffer, direct)
                  for i, p in enumerate(paths)]:
            f.result()  # a failed write raises here
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # the new names durable too, as a save's are
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - began
    for p in paths:
        p.unlink()
    buffer.release()
    memory.close()
    return elapsed


def write_read_file(path: Path, nbytes: int, threads: int) -> None:
    """The file the read rows read: `nbytes` (rounded up to whole pages, for O_DIRECT) of random bytes,
    durable; written by `threads` threads (a few seconds less of an 8 GB run than one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    nbytes = -(-nbytes // PAGE) * PAGE
    memory = mmap.mmap(-1, CHUNK)
    memory.write(os.urandom(CHUNK))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(offset: int) -> None:
        with memoryview(memory) as buffer:
            view = buffer[:min(CHUNK, nbytes - offset)]
            while len(view):  # pwrite may write less than asked
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(write, range(0, nbytes, CHUNK)))
        os.fsync(fd)
    finally:
        os.close(fd)
    memory.close()


def raw_read_s(path: Path, threads: int, *, direct: bool = False) -> float:
    """Seconds to read `path` whole, from the disk (evicted from the page cache first), in READ_CHUNK reads
    taken in file order by `threads` threads, each into its own page-aligned buffer."""
    nbytes = os.stat(path).st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages (the file was fsynced): all dropped
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    memories = [mmap.mmap(-1, READ_CHUNK) for _ in range(threads)]
    free: queue.SimpleQueue = queue.SimpleQueue()
    for m in memories:
        free.put(m)

    def read(offset: int) -> None:
        memory = free.get()
        try:
            with memoryview(memory) as view:
                want = min(READ_CHUNK, nbytes - offset)
                got = 0
                while got < want:  # the file is whole pages long: O_DIRECT reads stay aligned
                    n = os.preadv(fd, [view[got:want]], offset + got)
                    if n == 0:
                        raise EOFError(f"{path} ends at byte {offset + got}")
                    got += n
        finally:
            free.put(memory)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: None, range(threads)))
            began = time.perf_counter()
            list(pool.map(read, range(0, nbytes, READ_CHUNK)))  # raises a failed read's error
            elapsed = time.perf_counter() - began
    finally:
        os.close(fd)
        for m in memories:
            m.close()
    return elapsed

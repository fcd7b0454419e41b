"""Where checkpoint bytes live: a small interface, the local filesystem, and fsspec filesystems.

Paths given to a storage are relative to its root and use "/" separators.
"""
from __future__ import annotations

import abc
import ctypes
import errno
import os
import shutil
from pathlib import Path
from typing import Any


class FileSink(abc.ABC):
    """One file being written; `finish` makes it durable (and, for local files, closes it)."""

    @abc.abstractmethod
    def write_at(self, offset: int, data: memoryview) -> None: ...

    @abc.abstractmethod
    def finish(self) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None: ...

    def preallocate(self, nbytes: int) -> None:
        """The file will hold `nbytes` bytes: a sink may reserve the space now (optional)."""


class Storage(abc.ABC):
    """The operations checkpointing needs; implement it to checkpoint somewhere new.

    `parallel_writes`: `FileSink.write_at` may be called from several threads, in any order.
    Otherwise writes arrive in increasing, gap-free offsets from one thread.
    `atomic_rename`: renaming a directory is atomic and cheap (a POSIX filesystem). Otherwise
    ranks write a step in place and only the commit record makes it visible.
    """

    parallel_writes: bool = False
    atomic_rename: bool = False

    @abc.abstractmethod
    def makedirs(self, path: str) -> None: ...

    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names directly under `path`; empty when it does not exist."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def open_sink(self, path: str) -> FileSink: ...

    @abc.abstractmethod
    def write_file(self, path: str, data: bytes) -> None:
        """Write a whole small file so that readers see all of it or nothing; durable on return."""

    @abc.abstractmethod
    def read_file(self, path: str) -> bytes: ...

    @abc.abstractmethod
    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill `out` with the bytes at [offset, offset + len(out)) of the file."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """The file's length in bytes; FileNotFoundError when it does not exist."""

    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None: ...

    @abc.abstractmethod
    def remove(self, path: str) -> None:
        """Remove a file or a directory tree; missing is fine."""

    def sync_dir(self, path: str) -> None:
        """Make the directory's entries (new files, renames) durable."""

    def describe(self, path: str) -> str:
        """How to name `path` in messages."""
        return path


def _libc_function(name: str, argtypes: list):
    """A Linux libc function that Python's os module does not expose; None elsewhere."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
_FALLOCATE = _libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait for it
_EARLY_WRITEBACK_BYTES = 1 << 20
# Direct I/O moves whole pages: offset, length and memory address all multiples of this (4096 covers
# every logical block size in use: 512 and 4096).
DIRECT_ALIGNMENT = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIRECT_REFUSED = (errno.EINVAL, errno.EFAULT, errno.EOPNOTSUPP)


def _address(data: memoryview) -> int | None:
    """Where `data`'s bytes are in memory; None for read-only buffers (bytes), which go buffered."""
    if data.readonly or not data.nbytes:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(data))


class _LocalSink(FileSink):
    """A data file written with pwrite from any thread. With direct I/O, the page-aligned middle of each
    write goes to the disk through an O_DIRECT descriptor (no copy into the page cache, which on the
    machines measured held buffered writes to a fraction of the disk's speed: docs/benchmarks.md); its
    unaligned ends go through the page cache. The two never share a page (the direct part is whole
    pages of the write's own bytes), so neither sees stale data of the other; fsync covers both."""

    def __init__(self, path: Path, fsync: bool, direct: bool):
        self.path, self.fsync = path, fsync
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.direct_fd: int | None = None
        if direct and _O_DIRECT:
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | _O_DIRECT)
            except OSError:  # the filesystem refuses direct I/O (tmpfs on older kernels, some FUSE): buffered
                pass
        self.direct_failed = False

    def preallocate(self, nbytes: int) -> None:
        # Direct writes into allocated space need no block allocation under the inode lock, so several
        # threads' writes proceed at once; a full disk fails here, before any byte is written.
        if self.direct_fd is None or _FALLOCATE is None or nbytes <= 0:
            return
        if _FALLOCATE(self.fd, 0, 0, nbytes) != 0:
            err = ctypes.get_errno()
            if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return  # the filesystem cannot preallocate: the writes allocate as they go
            raise OSError(err, f"could not reserve {nbytes} bytes for {self.path}: {os.strerror(err)}")

    def write_at(self, offset: int, data: memoryview) -> None:
        data = data.cast("B")
        head = -offset % DIRECT_ALIGNMENT
        address = _address(data) if self.direct_fd is not None and not self.direct_failed else None
        if address is None or (address + head) % DIRECT_ALIGNMENT or len(data) - head < DIRECT_ALIGNMENT:
            self._buffered(offset, data)
            return
        middle = (len(data) - head) // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT
        self._buffered(offset, data[:head])
        if not self._direct(offset + head, data[head:head + middle]):
            self._buffered(offset + head, data[head:head + middle])
        self._buffered(offset + head + middle, data[head + middle:])

    def _direct(self, offset: int, data: memoryview) -> bool:
        """Write through the O_DIRECT descriptor; False where it is refused (the caller writes
        buffered, as this sink does from then on)."""
        try:
            while len(data):
                written = os.pwrite(self.direct_fd, data, offset)
                if written % DIRECT_ALIGNMENT:  # a short direct write off the page grid: finish buffered
                    self._buffered(offset + written, data[written:])
                    return True
                data, offset = data[written:], offset + written
        except OSError as e:
            # EINVAL: the filesystem or device refuses this alignment; EFAULT: memory the kernel cannot
            # pin for DMA (some drivers' page-locked host memory). A bad buffer fails buffered too.
            if e.errno not in _DIRECT_REFUSED:
                raise
            self.direct_failed = True
            return False
        return True

    def _buffered(self, offset: int, data: memoryview) -> None:
        start, nbytes = offset, len(data)
        while len(data):  # pwrite may write less than asked (signals, huge sizes)
            written = os.pwrite(self.fd, data, offset)
            data, offset = data[written:], offset + written
        if self.fsync and _SYNC_FILE_RANGE is not None and nbytes >= _EARLY_WRITEBACK_BYTES:
            # Let the disk start on these pages now instead of at the final fsync: a few GiB stay
            # below the kernel's own writeback threshold, and would otherwise all wait for fsync.
            _SYNC_FILE_RANGE(self.fd, start, nbytes, _SYNC_FILE_RANGE_WRITE)

    def finish(self) -> None:
        try:
            if self.fsync:
                os.fsync(self.fd)  # the file's data (direct writes included) and its metadata
        finally:
            self.abort()

    def abort(self) -> None:
        if self.direct_fd is not None:
            os.close(self.direct_fd)
        os.close(self.fd)


class LocalStorage(Storage):
    """A directory on a POSIX filesystem, with fsync of files and directories.

    `direct_io`: write the page-aligned parts of data files with O_DIRECT, past the page cache (their
    space preallocated); small files and unaligned bytes stay buffered; a filesystem that refuses
    O_DIRECT is written buffered, silently.
    `direct_reads` (default: as `direct_io`): read the page-aligned parts of data files with O_DIRECT
    where the memory read into allows it (a GPU load's pinned buffers; see read_into), the rest and a
    filesystem that refuses it buffered. A cold load then reads past the page cache, without filling it. Off by default: on the H200 host buffered writes with fsync
    were as fast or faster (3.46 s raw for 8.6 GB against 4.03 s direct), on a small VM direct I/O was up
    to several times faster (docs/benchmarks.md): measure your disk with tools/bench/checkpoint.
    `fsync=False` skips the flushes (tests on tmpfs); commits are then no longer crash-safe.
    """

    parallel_writes = True
    atomic_rename = True

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True, direct_io: bool = False,
                 direct_reads: bool | None = None):
        if not isinstance(direct_io, bool):
            raise TypeError(f"direct_io must be True or False, got {direct_io!r}")
        if direct_reads is not None and not isinstance(direct_reads, bool):
            raise TypeError(f"direct_reads must be True, False or None (as direct_io), got {direct_reads!r}")
        self.root = Path(root)
        self.fsync = fsync
        self.direct_io = direct_io
        self.direct_reads = direct_io if direct_reads is None else direct_reads
        self._direct_reads_refused = False  # set once O_DIRECT reads fail with EINVAL & co: buffered from then on

    def _p(self, path: str) -> Path:
        return self.root / path if path else self.root

    def makedirs(self, path: str) -> None:
        self._p(path).mkdir(parents=True, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        try:
            return os.listdir(self._p(path))
        except FileNotFoundError:
            return []

    def exists(self, path: str) -> bool:
        return self._p(path).exists()

    def open_sink(self, path: str) -> FileSink:
        return _LocalSink(self._p(path), self.fsync, self.direct_io)

    def write_file(self, path: str, data: bytes) -> None:
        final = self._p(path)
        partial = final.with_name(final.name + ".partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while len(view):
                view = view[os.write(fd, view):]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, final)  # readers never see a half-written record
        self.sync_dir(str(Path(path).parent) if "/" in path else "")

    def read_file(self, path: str) -> bytes:
        return self._p(path).read_bytes()

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """With direct I/O, the page-aligned middle of the range goes past the page cache when `out` sits at
        the file offset modulo a page (a GPU load's pinned buffers do); the rest, and all else, buffered."""
        out = out.cast("B")
        head = -offset % DIRECT_ALIGNMENT
        address = _address(out) if self.direct_reads and _O_DIRECT and not self._direct_reads_refused else None
        if address is None or (address + head) % DIRECT_ALIGNMENT or len(out) - head < DIRECT_ALIGNMENT:
            self._read_buffered(path, offset, out)
            return
        middle = (len(out) - head) // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT
        self._read_buffered(path, offset, out[:head])
        done = self._read_direct(path, offset + head, out[head:head + middle])
        self._read_buffered(path, offset + head + done, out[head + done:])  # what direct I/O did not read

    def _read_direct(self, path: str, offset: int, out: memoryview) -> int:
        """Bytes read into `out` through an O_DIRECT descriptor, whole pages; short where the file ends
        early (the buffered read of the rest says where) or where direct I/O is refused (0, and buffered from then on)."""
        done = 0
        try:
            fd = os.open(self._p(path), os.O_RDONLY | _O_DIRECT)
        except OSError as e:
            if e.errno not in _DIRECT_REFUSED:
                raise
            self._direct_reads_refused = True
            return 0
        try:
            while done < len(out):
                got = os.preadv(fd, [out[done:]], offset + done)
                done += got
                if got == 0 or got % DIRECT_ALIGNMENT:  # the end of the file: the caller reads the rest buffered
                    return done - done % DIRECT_ALIGNMENT
        except OSError as e:
            if e.errno not in _DIRECT_REFUSED:
                raise
            self._direct_reads_refused = True
        finally:
            os.close(fd)
        return done

    def _read_buffered(self, path: str, offset: int, out: memoryview) -> None:
        start, end = offset, offset + len(out)
        if not len(out):
            return
        fd = os.open(self._p(path), os.O_RDONLY)
        try:
            while len(out):  # preadv may read less than asked (signals, huge sizes)
                got = os.preadv(fd, [out], offset)
                if got == 0:
                    raise EOFError(f"{self._p(path)} ends at byte {os.fstat(fd).st_size}, before the end of the "
                                   f"range [{start}, {end}) read")
                out, offset = out[got:], offset + got
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        return os.stat(self._p(path)).st_size

    def rename(self, src: str, dst: str) -> None:
        os.rename(self._p(src), self._p(dst))

    def remove(self, path: str) -> None:
        p = self._p(path)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)

    def sync_dir(self, path: str) -> None:
        if not self.fsync:
            return
        fd = os.open(self._p(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def describe(self, path: str) -> str:
        return str(self._p(path))

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"


class _FsspecSink(FileSink):
    def __init__(self, storage: FsspecStorage, path: str):
        self.file = storage.fs.open(storage._p(path), "wb")
        self.position = 0

    def write_at(self, offset: int, data: memoryview) -> None:
        assert offset == self.position, f"sequential sink got offset {offset}, expected {self.position}"
        self.file.write(data.cast("B"))
        self.position += data.nbytes

    def finish(self) -> None:
        self.file.close()  # object stores make the object durable and visible on close

    def abort(self) -> None:
        self.file.close()


class FsspecStorage(Storage):
    """Any fsspec filesystem (object stores, memory://, ...): sequential writes, range reads.

    Renames are atomic only on some filesystems (local, memory); elsewhere a step is written in
    place and becomes visible through its commit record alone.
    """

    parallel_writes = False

    def __init__(self, url: str, **storage_options: Any):
        try:
            import fsspec
        except ImportError as e:  # the optional extra
            raise ImportError(
                f"checkpointing to {url!r} needs fsspec: pip install 'torch-checkpointing[fsspec]'"
            ) from e
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **storage_options)
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else tuple(self.fs.protocol)
        self.atomic_rename = bool({"memory", "file", "local"} & set(protocols))

    def _p(self, path: str) -> str:
        return f"{self.root.rstrip('/')}/{path}" if path else self.root

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(self._p(path), exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(self._p(path), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._p(path))

    def open_sink(self, path: str) -> FileSink:
        return _FsspecSink(self, path)

    def write_file(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(self._p(path), bytes(data))

    def read_file(self, path: str) -> bytes:
        return self.fs.cat_file(self._p(path))

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        out = out.cast("B")
        data = self.fs.cat_file(self._p(path), start=offset, end=offset + len(out))
        if len(data) != len(out):
            raise EOFError(f"{self.describe(path)} ends at byte {offset + len(data)}, before the end of the "
                           f"range [{offset}, {offset + len(out)}) read")
        out[:] = data

    def size(self, path: str) -> int:
        return self.fs.size(self._p(path))

    def rename(self, src: str, dst: str) -> None:
        self.fs.mv(self._p(src), self._p(dst), recursive=True)

    def remove(self, path: str) -> None:
        if self.fs.exists(self._p(path)):
            self.fs.rm(self._p(path), recursive=True)

    def describe(self, path: str) -> str:
        return f"{self.url.rstrip('/')}/{path}"

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"


def storage_for(path_or_storage: str | os.PathLike | Storage) -> Storage:
    """A Storage for a local path, an fsspec URL ("memory://...", "s3://..."), or a Storage as is."""
    if isinstance(path_or_storage, Storage):
        return path_or_storage
    if isinstance(path_or_storage, (str, os.PathLike)):
        text = os.fspath(path_or_storage)
        if "://" in text and not text.startswith("file://"):
            return FsspecStorage(text)
        return LocalStorage(text.removeprefix("file://"))
    raise TypeError(
        f"expected a path, an fsspec URL or a torch_checkpointing.Storage, got {type(path_or_storage).__name__}"
    )

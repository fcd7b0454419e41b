"""The job folder a run owns: an exclusive lock while the run lives, and the rule for a fresh run in a
folder that holds an earlier run's checkpoints.

Two runs writing one folder would interleave their checkpoints (retention keeps whichever steps are
highest) and their metrics lines; a fresh run (checkpoint.resume false) over an earlier run's
checkpoints would do the same the next time either is resumed. Both are refused before anything is
written, with a message saying what to do instead.
"""
from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

LOCK_FILE = "run.lock"


class RunFolderLock:
    """An exclusive flock on <folder>/run.lock, holding the owner's host and PID (released by release()
    or when the process ends, however it ends)."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / LOCK_FILE
        self._file = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            owner = self._file.read().strip() or "PID unknown (it is starting)"
            self._file.close()
            raise ValueError(f"job.folder {folder} is in use by another run ({owner}; lock file {self.path}): "
                             "wait for it to end, or choose another --job.folder") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"PID {os.getpid()} on {socket.gethostname()}\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            self._file.truncate(0)
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


def committed_checkpoints(folder: Path) -> list[int]:
    """The committed checkpoint steps under <folder>/checkpoints (none when there is no such folder)."""
    if not (folder / "checkpoints").is_dir():
        return []
    from torch_checkpointing import Checkpointer

    with Checkpointer(str(folder / "checkpoints")) as checkpoints:
        return checkpoints.steps()


def _claim(folder: Path, *, resume: bool) -> RunFolderLock:
    lock = RunFolderLock(folder)
    steps = [] if resume else committed_checkpoints(folder)
    if steps:
        lock.release()
        shown = ", ".join(map(str, steps[-5:]))
        raise ValueError(
            f"job.folder {folder} holds checkpoints of an earlier run (steps {shown}) and checkpoint.resume is "
            "false; a fresh run there would mix its checkpoints and metrics with that run's, so this one stops. "
            f"Resume it (--checkpoint.resume true), choose another --job.folder, or delete {folder / 'checkpoints'} "
            "to start over")
    return lock


def claim_run_folder(folder: Path, *, resume: bool, device: torch.device) -> RunFolderLock | None:
    """Lock `folder` for this run (rank 0 takes the lock; other ranks get None) and refuse a fresh run
    over an earlier run's checkpoints. Under torch.distributed every rank raises rank 0's ValueError, so
    no rank waits in a collective for one that stopped (`device`: this rank's, which carries the message
    under nccl)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    lock, error = None, None
    if rank == 0:
        try:
            lock = _claim(folder, resume=resume)
        except ValueError as e:
            error = str(e)
    if dist.is_initialized():
        shared = [error]
        dist.broadcast_object_list(shared, src=0, device=device if device.type == "cuda" else None)
        error = shared[0]
    if error is not None:
        if lock is not None:
            lock.release()
        raise ValueError(error)
    return lock


def check_run_folder(folder: Path, *, resume: bool, device: torch.device) -> None:
    """claim_run_folder's refusals without keeping the lock: called before the model is built, so a run
    that cannot go ahead says so at once rather than after loading its weights (the trainer claims the
    folder for good once it is built)."""
    lock = claim_run_folder(folder, resume=resume, device=device)
    if lock is not None:
        lock.release()

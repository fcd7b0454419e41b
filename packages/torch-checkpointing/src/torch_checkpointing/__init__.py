"""Distributed checkpointing: metadata exchanged once, async staging, atomic commit, resharding load."""

__version__ = "0.1.0"

from .adapters import ModelState, OptimizerState
from .checkpointer import Checkpointer, SaveHandle
from .commit import CommitError
from .config import CheckpointerConfig
from .integrity import ChecksumError
from .storage import FileSink, FsspecStorage, LocalStorage, Storage

__all__ = [
    "Checkpointer", "CheckpointerConfig", "SaveHandle", "ModelState", "OptimizerState",
    "Storage", "FileSink", "LocalStorage", "FsspecStorage", "ChecksumError", "CommitError",
]

"""The saver that test_crash.py kills: a process saving steps 1 and 2 and stopping forever inside step 2.

A module of its own (importable by name: conftest.py puts this folder on sys.path) because the saver
process is spawned, not forked, and a spawned child cannot import test files under pytest's names.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import torch_checkpointing as tc


class PausingStorage(tc.LocalStorage):
    """Stops forever at one point of saving step 2, after saying so through a marker file."""

    def __init__(self, root, point: str, marker: Path):
        super().__init__(root)
        self.point, self.marker = point, marker

    def _pause(self) -> None:
        self.marker.write_text(self.point)
        while True:
            time.sleep(1)

    def open_sink(self, path):
        sink = super().open_sink(path)
        if self.point == "data" and "step-2" in path:
            write_at = sink.write_at

            def write_then_pause(offset, data):
                write_at(offset, data)
                self._pause()  # the header is written, the tensors are not

            sink.write_at = write_then_pause
        return sink

    def write_file(self, path, data):
        if self.point == "metadata" and path.endswith("step-2/metadata.json"):
            self._pause()  # every rank is done; rank 0 has not published
        if self.point == "commit" and path == "step-2/commit.json":
            self._pause()  # renamed to step-2, but no commit record
        super().write_file(path, data)


def state(step: int) -> dict:
    return {"w": torch.full((256, 256), float(step)), "step": step}


def saver(root: str, point: str, marker: str) -> None:
    ckpt = tc.Checkpointer(PausingStorage(root, point, Path(marker)))
    ckpt.save(1, state(1), blocking=True)
    ckpt.save(2, state(2), blocking=True)
    os._exit(1)  # not reached: killed while saving step 2

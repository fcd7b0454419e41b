"""A process killed (SIGKILL) in the middle of a save: earlier steps stay loadable, the unfinished
step is invisible, and the next run's first save removes it."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
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


@pytest.mark.parametrize("point", ["data", "metadata", "commit"])
def test_sigkill_during_a_save(tmp_path, point):
    root, marker = tmp_path / "ckpt", tmp_path / "paused"
    process = multiprocessing.get_context("fork").Process(target=saver, args=(str(root), point, str(marker)))
    process.start()
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert process.is_alive() and time.monotonic() < deadline, "the saver never reached the pause point"
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    assert process.exitcode == -signal.SIGKILL
    leftover = {"data": ".tmp-step-2", "metadata": ".tmp-step-2", "commit": "step-2"}[point]
    assert (root / leftover).exists()

    ckpt = tc.Checkpointer(root)
    assert ckpt.steps() == [1] and ckpt.latest_step() == 1
    target = {"w": torch.zeros(256, 256), "step": 0}
    assert ckpt.load(target) == 1
    assert torch.equal(target["w"], state(1)["w"]) and target["step"] == 1
    ckpt.save(3, state(3), blocking=True)  # the first save of a run removes the unfinished step
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-3"]
    ckpt.close()

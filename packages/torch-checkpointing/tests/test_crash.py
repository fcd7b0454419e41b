"""A process killed (SIGKILL) in the middle of a save: earlier steps stay loadable, the unfinished
step is invisible, and the next run's first save removes it."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

import torch_checkpointing as tc
from ckpt_pausing_saver import saver, state


@pytest.mark.parametrize("point", ["data", "metadata", "commit"])
def test_sigkill_during_a_save(tmp_path, point):
    root, marker = tmp_path / "ckpt", tmp_path / "paused"
    process = multiprocessing.get_context("spawn").Process(target=saver, args=(str(root), point, str(marker)))
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

"""An asynchronous save that fails (a full disk, a read-only folder: injected through the storage)
surfaces at the trainer's next per-step poll or its next save, as a CommitError naming the step; its
unfinished folder is removed at once and the steps committed before it stay loadable."""
from __future__ import annotations

import errno
import time

import pytest
import torch

import torch_checkpointing as tc

FAILING_STEP = 3


class FailingStorage(tc.LocalStorage):
    """Local storage that fails one operation of saving step 3, as a full or read-only disk would."""

    def __init__(self, root, point: str):
        super().__init__(root, fsync=False)
        self.point = point

    @staticmethod
    def _fail(code: int) -> None:
        raise OSError(code, f"{errno.errorcode[code]} (injected)")

    def open_sink(self, path):
        sink = super().open_sink(path)
        if self.point == "data" and f"step-{FAILING_STEP}/" in path:
            write_at = sink.write_at

            def write_some(offset, data):
                if offset > 0:  # the header is written, then the disk is full
                    self._fail(errno.ENOSPC)
                write_at(offset, data)

            sink.write_at = write_some
        return sink

    def write_file(self, path, data):
        in_step = f"step-{FAILING_STEP}/" in path
        if in_step and ((self.point == "record" and path.endswith(".json") and "/rank-" in path)
                        or (self.point == "metadata" and path.endswith("metadata.json"))
                        or (self.point == "commit" and path.endswith("commit.json"))):
            self._fail(errno.EROFS if self.point == "record" else errno.ENOSPC)
        super().write_file(path, data)

    def rename(self, src, dst):
        if self.point == "rename" and dst == f"step-{FAILING_STEP}":
            self._fail(errno.EROFS)
        super().rename(src, dst)


def state(step: int) -> dict:
    return {"w": torch.full((128, 128), float(step)), "step": step}


def poll_until_it_raises(ckpt: tc.Checkpointer, timeout_s: float = 60.0) -> None:
    """What a trainer does: one raise_if_failed() per step while training goes on."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ckpt.raise_if_failed()
        time.sleep(0.005)
    raise AssertionError(f"the failed save was not reported within {timeout_s} s")


@pytest.mark.parametrize("surfaced_by", ["poll", "next save"])
@pytest.mark.parametrize("point", ["data", "record", "metadata", "rename", "commit"])
def test_a_failed_async_save_stops_the_run_and_leaves_the_last_step(tmp_path, point, surfaced_by):
    ckpt = tc.Checkpointer(FailingStorage(tmp_path, point), keep_last=2)
    ckpt.save(1, state(1))
    ckpt.save(2, state(2)).wait()
    handle = ckpt.save(FAILING_STEP, state(FAILING_STEP))  # returns once staged; the write fails behind it
    expected = rf"step {FAILING_STEP} .*(ENOSPC|EROFS) \(injected\)"
    if surfaced_by == "poll":
        with pytest.raises(tc.CommitError, match=expected):
            poll_until_it_raises(ckpt)
    else:
        while not handle.done():
            time.sleep(0.005)
        with pytest.raises(tc.CommitError, match=expected):
            ckpt.save(FAILING_STEP + 1, state(FAILING_STEP + 1))
    ckpt.raise_if_failed()  # reported once
    # the unfinished folder is gone at once; a note says why (the next run's first save removes it)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".failed-step-{FAILING_STEP}", "step-1", "step-2"]
    assert "(injected)" in (tmp_path / f".failed-step-{FAILING_STEP}").read_text()
    target = {"w": torch.zeros(128, 128), "step": 0}
    assert tc.Checkpointer(tmp_path).load(target) == 2
    assert torch.equal(target["w"], state(2)["w"]) and target["step"] == 2
    ckpt.close()  # the failure was reported already: close() does not raise it again

    with tc.Checkpointer(tmp_path, keep_last=2) as resumed:  # the next run saves that step again
        resumed.save(FAILING_STEP, state(FAILING_STEP), blocking=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", f"step-{FAILING_STEP}"]


def test_an_unreported_failure_is_raised_by_close(tmp_path):
    ckpt = tc.Checkpointer(FailingStorage(tmp_path, "data"))
    ckpt.save(FAILING_STEP, state(FAILING_STEP))
    with pytest.raises(OSError, match="injected"):
        ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".failed-step-{FAILING_STEP}"]

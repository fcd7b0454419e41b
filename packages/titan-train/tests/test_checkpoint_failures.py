"""Checkpoints that fail or are damaged: an asynchronous save that fails stops the run at the next
step (not at its end), leaving the last committed step and no unfinished folder; a damaged newest
checkpoint is not resumed from: the run falls back to the step before it and redoes the same steps."""
from __future__ import annotations

import errno
import json

import pytest

import torch_checkpointing as tc
from titan_train import train
from torch_checkpointing import CommitError


def logged_steps(folder) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_failed_async_save_stops_the_run_at_the_next_step(tmp_path, jobs, monkeypatch):
    open_sink = tc.LocalStorage.open_sink

    def full_disk_at_step_8(self, path):
        if path.startswith(".tmp-step-8/"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return open_sink(self, path)

    monkeypatch.setattr(tc.LocalStorage, "open_sink", full_disk_at_step_8)
    config = jobs.tiny(tmp_path, **{"training.steps": "14", "checkpoint.interval": "4",
                                    "checkpoint.async_save": "true"})
    with pytest.raises(CommitError, match=r"checkpointing to .*checkpoints failed, so the run stops: step 8 .*"
                                          r"No space left on device \(injected\); step 4 is the newest committed"):
        train(config)
    # The write fails right after step 8 is staged; the next steps' poll sees it long before the
    # save at step 12 would have (and without the poll, the run went on to step 14).
    assert max(logged_steps(tmp_path)) < 12, logged_steps(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    assert not list(checkpoints.glob(".tmp-step-*")) and tc.Checkpointer(checkpoints).steps() == [4]


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, jobs):
    # A constant schedule: the resumed run asks for more steps, which would move a decaying schedule's steps 5-6.
    job = {"checkpoint.interval": "2", "checkpoint.async_save": "false", "checkpoint.resume": "true",
           "lr_schedule.kind": "constant"}
    first = train(jobs.tiny(tmp_path, **job, **{"training.steps": "6"})).losses
    metadata = tmp_path / "checkpoints" / "step-6" / "metadata.json"
    raw = bytearray(metadata.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit
    metadata.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match=r"step 6 .* is damaged .*step-6/metadata\.json.*damaged-step-6"):
        resumed = train(jobs.tiny(tmp_path, **job, **{"training.steps": "8"}))
    assert resumed.start_step == 4 and sorted(resumed.losses) == [5, 6, 7, 8]
    assert resumed.losses[5] == first[5] and resumed.losses[6] == first[6]  # bitwise: the same steps again
    assert (tmp_path / "checkpoints" / "damaged-step-6").is_dir()

"""fsspec storage (memory://): the same promises through sequential writes and range reads."""
from __future__ import annotations

import uuid

import pytest
import torch

import torch_checkpointing as tc

pytest.importorskip("fsspec", reason="fsspec is the optional extra torch-checkpointing[fsspec]")


def url() -> str:
    return f"memory://ckpt-{uuid.uuid4().hex}"


@pytest.mark.parametrize("atomic_rename", [True, False], ids=["rename", "in-place"])
def test_memory_round_trip_retention_and_cleanup(atomic_rename):
    storage = tc.FsspecStorage(url())
    storage.atomic_rename = atomic_rename  # as on an object store: steps are written in place
    with tc.Checkpointer(storage, keep_last=2, block_bytes=4096) as ckpt:
        for step in range(1, 4):
            ckpt.save(step, {"w": torch.full((100, 50), float(step)), "b": b"x" * step, "n": step})
        ckpt.wait()
        assert ckpt.steps() == [2, 3]
        target = {"w": torch.zeros(100, 50, dtype=torch.float64), "b": b"", "n": 0}  # a cast: row reads
        assert ckpt.load(target, step=2) == 2
    assert torch.equal(target["w"], torch.full((100, 50), 2.0, dtype=torch.float64))
    assert target["b"] == b"xx" and target["n"] == 2
    storage.fs.pipe_file(storage._p(".tmp-step-9/rank-00000.safetensors"), b"partial")
    storage.fs.pipe_file(storage._p("step-8/rank-00000.safetensors"), b"no commit record")
    with tc.Checkpointer(storage) as ckpt:
        assert ckpt.steps() == [2, 3]
        ckpt.save(10, {"w": torch.ones(2)}, blocking=True)
    assert sorted(storage.listdir("")) == ["step-10", "step-2", "step-3"]


def test_memory_damage_is_found():
    storage = tc.FsspecStorage(url())
    older = torch.randn(64, 64)
    with tc.Checkpointer(storage) as ckpt:
        ckpt.save(0, {"w": older}, blocking=True)
        ckpt.save(1, {"w": torch.randn(64, 64)}, blocking=True)
        name = "step-1/rank-00000.safetensors"
        raw = bytearray(storage.read_file(name))
        raw[-5] ^= 1
        storage.fs.pipe_file(storage._p(name), bytes(raw))
        with pytest.raises(tc.ChecksumError, match=r"memory://ckpt-\w+/step-1/rank-00000\.safetensors: tensor 'w'"):
            ckpt.load({"w": torch.zeros(64, 64)}, step=1)
        target = {"w": torch.zeros(64, 64)}
        with pytest.warns(RuntimeWarning, match=r"step 1 .* is damaged .*tensor 'w'.* moved to memory://ckpt-\w+/damaged-step-1"):
            assert ckpt.load(target) == 0  # the latest intact step
        assert torch.equal(target["w"], older) and ckpt.steps() == [0]

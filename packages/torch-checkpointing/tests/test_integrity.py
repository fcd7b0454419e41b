"""Checksums: a damaged byte is found on load, and the error names the file and the tensor."""
from __future__ import annotations

import json

import pytest
import torch

import torch_checkpointing as tc


def save_and_damage(root, offset_in_tensor: int) -> dict:
    state = {"model": {"a": torch.randn(64, 64), "b": torch.randn(300, 100)}}
    with tc.Checkpointer(root, block_bytes=4096) as ckpt:
        ckpt.save(1, state, blocking=True)
    step_dir = root / "step-1"
    record = json.loads(next(step_dir.glob("rank-00000.*.json")).read_text())
    start, _ = record["stored"]["model.b"]["data_offsets"]
    data_file = step_dir / record["file"]
    raw = bytearray(data_file.read_bytes())
    raw[start + offset_in_tensor] ^= 0x10  # one flipped bit
    data_file.write_bytes(bytes(raw))
    return state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["same-layout", "cast-by-rows"])
def test_a_flipped_byte_names_file_and_tensor(tmp_path, dtype):
    state = save_and_damage(tmp_path, 80_000)
    ckpt = tc.Checkpointer(tmp_path)
    target = {"model": {"a": torch.zeros(64, 64, dtype=dtype), "b": torch.zeros(300, 100, dtype=dtype)}}
    with pytest.raises(tc.ChecksumError, match=r"step-1/rank-00000\.safetensors: tensor 'model\.b' .*bytes \[77824, 81920\)"):
        ckpt.load(target)
    intact = {"model": {"a": torch.zeros(64, 64)}}  # the damage is not in what this load reads
    ckpt.load(intact)
    assert torch.equal(intact["model"]["a"], state["model"]["a"])


def test_verification_can_be_switched_off(tmp_path):
    state = save_and_damage(tmp_path, 0)
    target = {"model": {"b": torch.zeros(300, 100)}}
    tc.Checkpointer(tmp_path, verify=False).load(target)
    differs = target["model"]["b"] != state["model"]["b"]
    assert differs.sum() == 1 and differs[0, 0]

"""Checksums: a damaged byte is found on load, and the error names the file and the tensor; a damaged
step (a flipped bit in any record or data file, a deleted or cut data file) is refused when asked for
by number and skipped, with a warning, when loading the latest."""
from __future__ import annotations

import json
import random
import re
import shutil

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
        ckpt.load(target, step=1)
    intact = {"model": {"a": torch.zeros(64, 64)}}  # the damage is not in what this load reads
    ckpt.load(intact, step=1)
    assert torch.equal(intact["model"]["a"], state["model"]["a"])


def test_verification_can_be_switched_off(tmp_path):
    state = save_and_damage(tmp_path, 0)
    target = {"model": {"b": torch.zeros(300, 100)}}
    tc.Checkpointer(tmp_path, verify=False).load(target)
    differs = target["model"]["b"] != state["model"]["b"]
    assert differs.sum() == 1 and differs[0, 0]


# ---- damaged steps: detected before anything is loaded, and "latest" falls back --------------------

def two_steps(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(300, generator=g)},
            "step": step, "blob": bytes([step]) * 10, "rng": torch.randint(0, 255, (8,), generator=g, dtype=torch.uint8)}


def zeros() -> dict:
    return {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(300)}, "step": 0, "blob": b"",
            "rng": torch.zeros(8, dtype=torch.uint8)}


def assert_state(loaded: dict, step: int) -> None:
    expected = two_steps(step)
    assert torch.equal(loaded["model"]["w"], expected["model"]["w"]) and torch.equal(loaded["model"]["b"], expected["model"]["b"])
    assert loaded["step"] == step and loaded["blob"] == expected["blob"] and torch.equal(loaded["rng"], expected["rng"])


def save_two_steps(root) -> None:
    with tc.Checkpointer(root, per_rank=("rng",), block_bytes=4096) as ckpt:
        for step in (1, 2):
            ckpt.save(step, two_steps(step), blocking=True)


def flip_bit(path, offset: int, bit: int = 0) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 1 << bit
    path.write_bytes(bytes(raw))


def flip_text(path, text: bytes, position: int) -> None:
    """Flip the lowest bit of byte `position` of the first occurrence of `text` (it must be there)."""
    at = path.read_bytes().index(text)
    flip_bit(path, at + position)


def record_of(step_dir):
    return next(step_dir.glob("rank-00000.*.json"))


def damage(step_dir, kind: str) -> str:
    """Damage step_dir in one way; returns the file the error must name."""
    data = step_dir / "rank-00000.safetensors"
    if kind == "metadata-chunk-offset":  # "offset":[0,0] -> [1,0]: a shifted load without the checksum
        before = json.loads((step_dir / "metadata.json").read_bytes())["tensors"]["model.w"]["chunks"][0]["offset"]
        flip_text(step_dir / "metadata.json", b'"offset":[0,0]', len(b'"offset":['))
        after = json.loads((step_dir / "metadata.json").read_bytes())["tensors"]["model.w"]["chunks"][0]["offset"]
        assert (before, after) == ([0, 0], [1, 0])  # still valid JSON, silently wrong but for the checksum
        return "metadata.json"
    if kind == "record-step":  # the state's "step" 2 -> 3: skipped steps without the checksum
        flip_text(record_of(step_dir), b'"step":{"value":2}', len(b'"step":{"value":'))
        assert json.loads(record_of(step_dir).read_bytes())["values"]["step"] == {"value": 3}
        return record_of(step_dir).name
    if kind == "record-deleted":
        name = record_of(step_dir).name
        (step_dir / name).unlink()
        return name
    if kind == "commit":
        flip_text(step_dir / "commit.json", b'"step":2', len(b'"step":'))
        return "commit.json"
    if kind == "shard-deleted":
        data.unlink()
    elif kind == "shard-truncated":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif kind == "shard-header":
        flip_bit(data, 100, 3)
    elif kind == "shard-data":
        flip_bit(data, data.stat().st_size - 3000, 5)
    return "rank-00000.safetensors"


DAMAGE = ["metadata-chunk-offset", "record-step", "record-deleted", "commit", "shard-deleted", "shard-truncated",
          "shard-header", "shard-data"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_step_is_refused_by_name_and_latest_falls_back(tmp_path, kind):
    save_two_steps(tmp_path)
    named = damage(tmp_path / "step-2", kind)
    ckpt = tc.Checkpointer(tmp_path, per_rank=("rng",))
    with pytest.raises(tc.ChecksumError, match=rf"step 2 cannot be loaded: .*step-2/{re.escape(named)}"):
        ckpt.load(zeros(), step=2)  # asked for by number: an error, and the step is left where it is
    assert ckpt.steps() == [1, 2]
    target = zeros()
    with pytest.warns(RuntimeWarning) as warned:
        assert ckpt.load(target) == 1
    message = str(warned[0].message)
    moved = tmp_path / "damaged-step-2"
    assert f"step-2/{named}" in message and f"rm -r {moved}" in message, message
    assert_state(target, 1)
    assert ckpt.steps() == [1] and moved.is_dir()
    ckpt.save(2, two_steps(2), blocking=True)  # redone after the fall-back, the step saves again
    target = zeros()
    assert ckpt.load(target) == 2
    assert_state(target, 2)
    ckpt.close()


def test_flipped_bits_anywhere_in_a_step_are_found(tmp_path):
    """One flipped bit at random places of every file of the newest step (fixed seed): each load of
    the latest falls back to the older step and restores it bit for bit."""
    pristine = tmp_path / "pristine"
    save_two_steps(pristine)
    rng = random.Random(27)
    files = sorted(p.name for p in (pristine / "step-2").iterdir())
    assert len(files) == 4  # commit, metadata, the rank record, the data file
    trials = 0
    for name in files:
        size = (pristine / "step-2" / name).stat().st_size
        positions = [0, size - 1] + [rng.randrange(size) for _ in range(6)]
        for position in positions:
            root = tmp_path / f"trial-{trials}"
            shutil.copytree(pristine, root)
            flip_bit(root / "step-2" / name, position, rng.randrange(8))
            target = zeros()
            with pytest.warns(RuntimeWarning, match=rf"step 2 .* is damaged .*step-2/{re.escape(name)}"):
                assert tc.Checkpointer(root, per_rank=("rng",)).load(target) == 1, (name, position)
            assert_state(target, 1)
            trials += 1
    assert trials == 32


def test_every_step_damaged_is_an_error(tmp_path):
    save_two_steps(tmp_path)
    damage(tmp_path / "step-1", "shard-data")
    damage(tmp_path / "step-2", "commit")
    with pytest.warns(RuntimeWarning), pytest.raises(tc.ChecksumError, match=r"every committed step .* is damaged"):
        tc.Checkpointer(tmp_path, per_rank=("rng",)).load(zeros())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged-step-1", "damaged-step-2"]

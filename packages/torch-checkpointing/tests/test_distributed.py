"""Several gloo ranks: exchange once, no collectives later, resharding N -> M -> 1, FSDP2 resume."""
from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

import torch_checkpointing as tc
from ckpt_spawn import run_ranks
from ckpt_workers import (
    damage_and_failure_on_two, fsdp2_resume, global_tensors, hook_tensors, hooks_round_trip, load_on_two, save_on_four,
)


def plain_target(step_zeros: bool = True) -> dict:
    g = {k: torch.zeros_like(v) for k, v in global_tensors(0).items()}
    return {
        "model": {name: g[name] for name in ("w", "v", "r", "s", "t", "big", "bias")},
        "optim": {"state": {"w": {"exp_avg": g["exp_avg"], "step": torch.tensor(0.0)}},
                  "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": [], "foreach": None}]},
        "step": -1,
        "nested": [[g["n0"], {"k": ""}], 0, []],
    }


def check_plain(state: dict, step: int) -> None:
    g = global_tensors(step)
    for name, value in state["model"].items():
        assert torch.equal(value, g[name]), name
    assert torch.equal(state["optim"]["state"]["w"]["exp_avg"], g["exp_avg"])
    assert state["optim"]["state"]["w"]["step"].item() == step
    assert state["optim"]["param_groups"] == [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["w"], "foreach": None}]
    assert state["step"] == step
    assert torch.equal(state["nested"][0][0], g["n0"]) and state["nested"][2] == [1.5, float("inf")]


def test_four_ranks_then_two_then_one(tmp_path):
    """4 ranks save (1-D/2-D meshes, uneven, replicated, strided); 2 ranks load a later step into
    other placements and save again; one process loads both steps as plain tensors."""
    root = tmp_path / "ckpt"
    run_ranks(4, tmp_path / "pg4", save_on_four, str(root))
    metadata = json.loads((root / "step-2" / "metadata.json").read_text())
    assert metadata["world_size"] == 4
    # each element of each tensor is stored exactly once: Replicate dims are written by one replica
    for name, entry in metadata["tensors"].items():
        numel = torch.Size(entry["shape"]).numel()
        assert sum(torch.Size(c["shape"]).numel() for c in entry["chunks"]) == numel, name
    assert len(metadata["tensors"]["model.s"]["chunks"]) > 4  # strided shards: runs stored as boxes

    run_ranks(2, tmp_path / "pg2", load_on_two, str(root), str(tmp_path / "failing"), str(tmp_path / "hf"))
    assert tc.Checkpointer(root).steps() == [1, 2, 3, 4]

    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    exported = {}
    for name in sorted(set(index["weight_map"].values())):
        exported.update(safetensors.torch.load_file(tmp_path / "hf" / name))
    g = global_tensors(4)
    assert exported.keys() == {"w", "v", "r", "s", "t", "big", "bias"}
    for name, value in exported.items():
        assert torch.equal(value, g[name]), name

    with tc.Checkpointer(root, per_rank=("rng",)) as ckpt:
        for step in (4, 2):  # saved on 2 ranks, and on 4 ranks
            target = plain_target()
            assert ckpt.load(target, step=step) == step
            check_plain(target, step)
        with pytest.raises(ValueError, match="rng"):  # per-rank and different on each saved rank
            ckpt.load({"rng": torch.zeros(4, dtype=torch.uint8)}, step=2)


def test_fsdp2_resume_and_single_process_load(tmp_path):
    root, full = tmp_path / "ckpt", tmp_path / "full.pt"
    run_ranks(2, tmp_path / "pg", fsdp2_resume, str(root), str(full))
    expected = torch.load(full)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tc.Checkpointer(root) as ckpt:
        state = {"model": tc.ModelState(model), "optim": tc.OptimizerState(model, optimizer), "step": 0}
        assert ckpt.load(state) == 4 and state["step"] == 4
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), expected[name]), name
    assert all(optimizer.state[p]["exp_avg"].abs().sum() > 0 for p in model.parameters())


def test_local_tensors_with_checkpoint_hooks(tmp_path):
    """DTensors whose local tensor implements DCP's hooks (torch's LocalShardsWrapper here; flexshard's
    ChunkedShard in tests/test_checkpoint_flexshard.py) are stored piece by piece at their offsets."""
    root = tmp_path / "ckpt"
    run_ranks(2, tmp_path / "pg", hooks_round_trip, str(root))
    chunks = json.loads((root / "step-1" / "metadata.json").read_text())["tensors"]
    assert sorted((c["rank"], c["offset"][1]) for c in chunks["d"]["chunks"]) == [(0, 0), (0, 8), (1, 4), (1, 12)]
    assert sorted((c["rank"], tuple(c["shape"])) for c in chunks["e"]["chunks"]) == [(0, (5, 3)), (0, (5, 5))]
    assert sorted((c["rank"], c["offset"][1]) for c in json.loads((root / "step-3" / "metadata.json").read_text())
                  ["tensors"]["d"]["chunks"]) == [(0, 4), (0, 12), (1, 0), (1, 8)]  # swapped blocks
    with tc.Checkpointer(root) as ckpt:
        for step in (1, 2, 3):
            plain = {k: torch.zeros_like(v) for k, v in hook_tensors(step).items()}
            assert ckpt.load(plain, step=step) == step
            for name, value in plain.items():
                assert torch.equal(value, hook_tensors(step)[name]), (step, name)


def test_damage_and_failed_saves_on_two_ranks(tmp_path):
    run_ranks(2, tmp_path / "pg", damage_and_failure_on_two, str(tmp_path / "ckpt"))

"""tools/bench/exec_layer/remat_frontier.py's plan of a GPU run, checked on a CPU without running it: its flags
parse as titan-train's, its counted state is the trainer's (the real 8B built on meta, state_bytes_per_param),
its peaks agree with tools/bench/train_throughput/memory_model.py's independent count, and the default run
holds only points that are counted to fit, at remat levels the planner accepts. Under a second."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tools/bench/exec_layer"), str(ROOT / "tools/bench/train_throughput")]

import frontier_memory  # noqa: E402
import memory_model  # noqa: E402
import remat_frontier  # noqa: E402

GIB = 2**30


def _config(argv):
    from titan_train.cli import parse_args

    config, actions = parse_args(argv)
    assert not actions
    return config


def test_the_8b_state_is_what_the_trainer_and_the_remat_planner_count():
    import titan_models
    from titan_train.memory_estimate import state_bytes_per_param

    args = remat_frontier.parse_args([])
    flags, shape = remat_frontier.model_setup(args)
    config = _config([*flags, "--training.batch_size", "2"])
    assert config.model.vocab_size == 128256 and config.optimizer.moment_dtype == "bfloat16"
    cfg = titan_models.transforms.num_layers(32)(titan_models.flavor("llama3", "8B"))
    with torch.device("meta"):
        n = sum(p.numel() for p in cfg.build().parameters())
    assert shape.parameters == n == 8_030_261_248
    assert shape.planner_static_bytes == state_bytes_per_param(config, torch.device("cuda")) * n  # 12 B/param
    assert 89 < shape.planner_static_bytes / GIB < 90


def test_a_kept_block_is_what_a_compiled_block_saves():
    """The planner's kept 8B block (profiled compiled on meta) is memory_model's layout of a compiled block,
    measured on the GPU through saved-tensor hooks: 7d + 3kv + 3ffn bf16 values a token, the fused q/k/v and
    gate/up weight concatenations, and flash attention's fp32 log-sum-exp and the two norms' fp32 rstd."""
    shape = remat_frontier.model_setup(remat_frontier.parse_args([]))[1]
    d, kv, ffn = shape.dim, shape.kv, shape.ffn
    assert shape.planner_keep_bytes_per_token == 2 * (7 * d + 3 * kv + 3 * ffn) + 4 * shape.heads + 2 * 4
    assert shape.planner_keep_fixed_bytes == frontier_memory._weight_cats(shape) == 272 * 2**20
    assert 1.40 < shape.planner_keep_bytes(2 * 4096) / GIB < 1.41  # was 3.68 counting every op's output


def test_the_planner_model_is_the_planners():
    """frontier_memory's model of the remat planner (its forward state, reserve and floor) is what titan-train's
    planner computes for the 8B (2 layers, on meta, with the fused SwiGLU a CUDA run swaps in) at batch 2:
    gradients counted from the backward on."""
    import dataclasses

    import titan_models
    from titan_train.kernels.swiglu import use_fused_swiglu
    from titan_train.memory_estimate import remat_static_memory
    from titan_train.remat import profile_blocks
    from titan_train.remat.apply import block_gradients
    from titan_train.remat.peak import backward_floor
    from titan_train.remat.plan import OPTIONS, choose

    args = remat_frontier.parse_args([])
    flags, shape = remat_frontier.model_setup(args)
    shape = dataclasses.replace(shape, layers=2)
    config = _config([*flags, "--training.batch_size", "2"])
    with torch.device("meta"):
        model = titan_models.transforms.num_layers(2)(titan_models.flavor("llama3", "8B")).build()
    assert use_fused_swiglu(model) == ["layers.0.feed_forward", "layers.1.feed_forward"]
    tokens = 2 * 4096
    memory = remat_static_memory(config, model, device=torch.device("cuda"), shards=1, tokens=tokens, autocast=False)
    assert not memory.gradients_persist
    assert memory.forward_bytes == shape.parameters * shape.forward_state_bytes  # 10 B/param: no gradients
    assert memory.gradient_bytes == shape.parameters * shape.grad_bytes
    profiles = profile_blocks(model, rows=2, seq_len=4096, dtype=torch.bfloat16, compiled=True)
    grads = block_gradients(model, memory.gradient_bytes)
    assert profiles[-1].saved_bytes == shape.planner_keep_bytes(tokens)
    transient = profiles[-1].held[None].backward_peak_bytes - profiles[-1].saved_bytes  # the last block's, kept
    assert transient == shape.planner_keep_transient_bytes(tokens) > 0
    # the embedding's gradient comes after the blocks'; the loss's 2048 x 128256 bf16 logits (the Triton kernel
    # writes their gradient over them) are freed before the head's gradient is made
    assert memory.late_gradient_bytes == 128256 * 4096 * 2 and memory.loss_chunk_bytes == 2048 * 128256 * 2
    early = memory.gradient_bytes - sum(grads) - memory.late_gradient_bytes
    assert shape.planner_reserve_bytes(tokens) == max(transient + early + grads[-1], memory.loss_bytes,
                                                      memory.loss_bytes - memory.loss_chunk_bytes + early)
    floor = backward_floor(profiles, memory, grads)
    assert shape.planner_floor_bytes(tokens) == floor
    # the floor is the walk at block 0 (above the end of the backward): its cheapest option's high mark with
    # every gradient made before it, not the embedding's nor the rest of block 0's own
    first = min((choose(profiles[0], n, o) for n, o in OPTIONS.items()),
                key=lambda c: c.saved_bytes + c.backward_transient_bytes + math.ceil(c.grad_share * grads[0]))
    made = memory.gradient_bytes - memory.late_gradient_bytes - grads[0]
    assert floor == (memory.forward_bytes + made + math.ceil(first.grad_share * grads[0]) + first.saved_bytes
                     + first.backward_transient_bytes) > memory.end_of_backward_bytes


@pytest.mark.parametrize("batch", [2, 4])
def test_counted_peaks_agree_with_memory_model(batch):
    shape, tokens = remat_frontier.model_setup(remat_frontier.parse_args([]))[1], batch * 4096
    lean = memory_model.expected_gib("titan_compile_lean", "8B", batch, 4096)  # selective ops, same settings
    assert frontier_memory.peak(shape, tokens, "ops") / GIB == pytest.approx(lean, rel=1e-12)
    none = memory_model.Setting(state_bytes=10, activations="titan_compile", loss_chunk=2048, weight_grad_bytes=2)
    none_gib = sum(memory_model.breakdown("8B", batch, 4096, none).values())
    assert frontier_memory.peak(shape, tokens, "none") / GIB == pytest.approx(none_gib, rel=1e-12)
    # full checkpointing's high mark is the backward's: all the state, gradients included, and one block
    full = frontier_memory.peak(shape, tokens, "full")
    assert shape.planner_static_bytes < full < shape.planner_static_bytes + 4 * GIB


def test_default_run_fits_and_every_point_parses():
    args = remat_frontier.parse_args([])
    flags, shape = remat_frontier.model_setup(args)
    points = remat_frontier.plan_points(shape, 2 * 4096, args)
    # each remat level runs right after the existing mode whose counted peak it is, + 1 GiB rounded up to 0.5:
    # full 91.15 -> 92.5 (above the planner's floor, 90.38: every gradient but the embedding's and block 0's
    # unmade share, + block 0's kept bytes and backward transient), ops 99.51 -> 101, none 121.51 -> 123
    assert [p.name for p in points] == ["full", "remat_92.5GiB", "ops", "remat_101GiB", "none", "remat_123GiB"]
    assert not any(p.skip for p in points)
    levels = [p.budget_gib for p in points if p.budget_gib is not None]
    assert all(shape.planner_floor_bytes(2 * 4096) / GIB < lv < args.capacity for lv in levels), levels
    for p in points:
        config = _config([*flags, "--training.batch_size", "2", *p.flags])
        config.activation_checkpoint.check()
        assert config.activation_checkpoint.memory_budget_gib == (p.budget_gib or 0.0)


def test_a_point_counted_past_the_capacity_is_skipped_not_run():
    args = remat_frontier.parse_args(["--grid"])
    shape = remat_frontier.model_setup(args)[1]
    skipped = {p.name: p.skip for p in remat_frontier.plan_points(shape, 4 * 4096, args) if p.skip}
    assert skipped == {"none": "predicted OOM"}  # 158 GiB counted at batch 4
    results = remat_frontier.run_points([remat_frontier.Point("none", [], 158.0, skip="predicted OOM")], [], 4, args,
                                        began=0.0)
    assert results == {"none": {"error": "predicted OOM"}}

"""The declared parallel plan of the hybrid families: every parameter has a tensor-parallel style,
and splitting a layer's weights by those styles into tp head shards (run one at a time, partial
outputs summed as the rowwise `wo` would) reproduces the whole layer."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from tm_reference import build, rel_err

import titan_models as tm
from titan_models.override import _matches


def _style(plan, name: str) -> str:
    module = name.rpartition(".")[0]
    styles = [style for pattern, style in plan.tensor_parallel.items() if _matches(pattern, module)]
    if not styles and any(_matches(pattern, module) for pattern in plan.experts):
        return "experts"  # routed experts are split by expert parallelism, not by heads
    assert len(styles) == 1, f"{name} has tensor-parallel styles {styles}"
    return styles[0]


@pytest.mark.parametrize(("family", "flavor"), [("qwen3_5", "debug"), ("qwen3_5", "debug_moe"),
                                                ("qwen3_next", "debug")])
def test_every_parameter_has_a_style(family, flavor):
    model = build(tm.flavor(family, flavor))
    for name, _ in model.named_parameters():
        _style(model.parallel_plan, name)
    plan = model.parallel_plan
    assert plan.pipeline_cut_points == tuple(f"layers.{i}" for i in range(1, model.config.num_layers))


def _shard(tensor: torch.Tensor, style: str, rank: int, tp: int) -> torch.Tensor:
    if style in ("colwise", "headwise"):
        return tensor.chunk(tp, dim=0)[rank]
    if style == "rowwise":
        return tensor.chunk(tp, dim=1)[rank]
    assert style == "replicate", style
    return tensor


@pytest.mark.parametrize("layer", ["0", "1"], ids=["gated-deltanet", "gated-attention"])
def test_head_split_by_the_plan_reproduces_the_layer(layer):
    tp = 2
    config = dataclasses.replace(tm.flavor("qwen3_5", "debug"), dim=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                 linear_value_head_dim=12, ffn_dim=96)
    model = build(config, seed=1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "decay" in name:
                param.uniform_(0.3, 1.2)
    whole = model.layers[layer].attention
    local = dataclasses.replace(config, num_heads=2, num_kv_heads=1, linear_num_key_heads=1, linear_num_value_heads=2)
    x = torch.randn(2, 70, 64, generator=torch.Generator().manual_seed(0))
    rope = model.rope(torch.arange(70).expand(2, 70))
    total = torch.zeros(2, 70, 64)
    with torch.no_grad():
        for rank in range(tp):
            shard = build(local).layers[layer].attention
            for name, param in shard.named_parameters():
                style = _style(model.parallel_plan, f"layers.{layer}.attention.{name}")
                param.copy_(_shard(whole.get_parameter(name), style, rank, tp))
            total += shard(x, rope)
        assert rel_err(total, whole(x, rope)) < 1e-5

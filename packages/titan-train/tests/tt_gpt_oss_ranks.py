"""Entry points of the spawned gloo ranks of test_gpt_oss.py (importable by module name in a fresh process)."""
from __future__ import annotations

import os

import torch

import titan_models as tm


def attention_rank(rank: int, world: int, init_method: str, out: dict) -> None:
    import torch.distributed as dist
    from titan_train_ranks import join_gloo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # what apply_tensor_parallel does for a "headwise" module (the whole gpt-oss model cannot be split:
    # the trainer has no tensor parallelism for MoE experts)
    from titan_train.parallelize import _compute_on_local_values

    join_gloo(rank, world, init_method)
    attention, x, rope = attention_case()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(attention, mesh, {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
                                         "wo": RowwiseParallel()})
    _compute_on_local_values(attention.sinks, mesh, Shard(0))
    assert attention.sinks.weight.to_local().shape == (4 // world,)
    with torch.no_grad():
        result = attention(x, rope)
    # rowwise o's output is an async all-reduce: every rank waits for it before the group goes away
    local = torch.tensor(result.tolist())
    if rank == 0:
        out["tp"] = local
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def attention_case():
    torch.manual_seed(0)
    config = tm.flavor("gpt_oss", "debug").attention_config("sliding_attention")
    attention = type(config)(**{**config.__dict__, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
                                "sliding_window": 5, "backend": "eager"}).build(32)
    with torch.no_grad():
        for p in attention.parameters():
            p.normal_(0.0, 0.5)
    x = torch.randn(2, 13, 32)
    rope = tm.components.rope.RopeConfig(dim=8).build()(torch.arange(13).expand(2, 13))
    return attention, x, rope

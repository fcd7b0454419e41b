"""gpt-oss through the trainer: the debug recipe learns, FSDP and a 2-stage pipeline follow the
single-process loss curve (sequences of 96 tokens, longer than the debug model's 64-key window), the
sinks' "headwise" TP style on gloo ranks equals the unsplit attention, and dist-moe refuses gpt-oss's MoE
with a clear error."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import titan_models as tm
from titan_train import load_recipe, train
from titan_train.expert_parallel import use_dist_moe

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import their entry point by module name
from titan_train_ranks import file_rendezvous  # noqa: E402
from tt_gpt_oss_ranks import attention_case, attention_rank  # noqa: E402

# gpt-oss has no aux-loss-free selection bias (its checkpoints hold none; pipelines refuse the update)
GPT_OSS = {"model.family": "gpt_oss", "training.seq_len": "96", "training.moe_bias_update_rate": "0"}
STEPS = {"training.steps": "6"}


def test_gpt_oss_debug_recipe_builds_the_family():
    config = load_recipe("gpt_oss_debug")
    assert (config.model.family, config.model.flavor) == ("gpt_oss", "debug")
    assert config.training.moe_bias_update_rate == 0.0


@pytest.fixture(scope="module")
def reference(tmp_path_factory, jobs):
    losses = train(jobs.tiny(tmp_path_factory.mktemp("single"), **GPT_OSS, **STEPS)).losses
    assert losses[6] < losses[1] - 0.5, f"the tiny gpt-oss job should learn: {losses}"
    return losses


LAYOUTS = {"fsdp2": {"parallelism.dp_shard": "2"}, "pp2": {"parallelism.pp": "2"}}


@pytest.fixture(scope="module")
def two_rank_curves(tmp_path_factory, jobs) -> dict[str, dict[int, float]]:
    """layout id -> loss curve on 2 gloo ranks, both runs in one spawn."""
    root = tmp_path_factory.mktemp("two_ranks")
    configs = [jobs.tiny(root / name, **GPT_OSS, **STEPS, **layout) for name, layout in LAYOUTS.items()]
    return dict(zip(LAYOUTS, jobs.each_on_ranks(configs, 2)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_layout_follows_single_process(reference, two_rank_curves, layout):
    expected, curve = reference, two_rank_curves[layout]
    assert sorted(curve) == sorted(expected)
    for step, loss in expected.items():  # tolerance as in test_parallel.py
        assert curve[step] == pytest.approx(loss, rel=1e-4), (step, curve, expected)


def test_dist_moe_refuses_gpt_oss_moe():
    with torch.device("meta"):
        model = tm.transforms.num_layers(1)(tm.flavor("gpt_oss", "debug")).build()
    with pytest.raises(ValueError, match="router_bias.*moe_impl=titan"):
        use_dist_moe(model, aux_loss_alpha=0.0)


def test_heads_style_shards_sinks_with_the_heads(tmp_path):
    """q/k/v colwise, o rowwise and the sinks "headwise" on 2 gloo ranks give the unsplit output."""
    attention, x, rope = attention_case()
    with torch.no_grad():
        want = attention(x, rope)
    with mp.Manager() as manager:
        out = manager.dict()
        os.environ["OMP_NUM_THREADS"] = "1"
        mp.start_processes(attention_rank, args=(2, file_rendezvous(tmp_path), out), nprocs=2, start_method="spawn")
        got = out["tp"]
    assert ((got - want).norm() / want.norm()).item() < 1e-6


def test_a_head_count_tp_cannot_split_names_the_field():
    from titan_train.parallelize import check_tp_divisibility

    with torch.device("meta"):
        model = tm.flavor("gpt_oss", "debug").build()  # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match="tp=3 does not divide the model's num_heads=4"):
        check_tp_divisibility(model, 3, 96)
    with pytest.raises(ValueError, match="tp=4 does not divide the model's num_kv_heads=2"):
        check_tp_divisibility(model, 4, 96)


def test_context_parallel_refuses_windows_and_sinks():
    from titan_train.context_parallel import apply_context_parallel

    with torch.device("meta"):
        model = tm.flavor("gpt_oss", "debug").build()
    with pytest.raises(ValueError, match="sliding windows or attention sinks.*layers.0.attention.inner"):
        apply_context_parallel(model, group=None)

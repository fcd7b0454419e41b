"""Muse Glimmer and Muse Spark through the trainer: the debug recipes build their families, the tiny jobs
learn with the soft-capped head in the fused loss, and FSDP (both), TP and a 2-stage pipeline (Glimmer)
on 2 gloo ranks follow the single-process loss curve (sequences of 96 tokens, longer than the debug models'
64-key windows)."""
from __future__ import annotations

import pytest
import torch

import titan_models as tm
from titan_train import load_recipe, train
from titan_train.expert_parallel import use_dist_moe

FAMILIES = ["muse_glimmer", "muse_spark"]
STEPS = {"training.steps": "6", "training.seq_len": "96", "model.num_layers": "4"}  # all four: a NoPE full layer too


@pytest.mark.parametrize("family", FAMILIES)
def test_debug_recipe_builds_the_family(family):
    config = load_recipe(f"{family}_debug")
    assert (config.model.family, config.model.flavor) == (family, "debug")


LAYOUTS = [("muse_glimmer", {"parallelism.dp_shard": "2"}), ("muse_spark", {"parallelism.dp_shard": "2"}),
           # a 2-stage pipeline: the first stage holds the embedding norm, the last the soft-capped head
           ("muse_glimmer", {"parallelism.pp": "2"}),
           # tensor parallel: q/k/v/wg colwise by heads, o rowwise, the post-branch norms replicated
           ("muse_glimmer", {"parallelism.tp": "2"})]


@pytest.mark.parametrize(("family", "layout"), LAYOUTS,
                         ids=["glimmer-fsdp2", "spark-fsdp2", "glimmer-pp2", "glimmer-tp2"])
def test_parallel_layout_follows_the_single_process_curve(tmp_path, jobs, family, layout):
    expected = train(jobs.tiny(tmp_path / "single", **{"model.family": family}, **STEPS)).losses
    assert expected[6] < expected[1] - 0.5, f"the tiny {family} job should learn: {expected}"
    curve = jobs.on_ranks(jobs.tiny(tmp_path / "ranks", **{"model.family": family}, **STEPS, **layout), 2)
    jobs.assert_follows(curve, expected)


def test_dist_moe_refuses_muse_spark_moe():
    with torch.device("meta"):
        model = tm.transforms.num_layers(2)(tm.flavor("muse_spark", "debug")).build()
    with pytest.raises(ValueError, match="router_logit_scale.*expert_pool_dim.*moe_impl=titan"):
        use_dist_moe(model, aux_loss_alpha=0.0)

"""DeepSeek-V4 through the trainer: the debug recipe learns on CPU, FSDP on 2 gloo ranks follows the
single-process loss curve (96-token sequences: 6 heavy and 24 sparse entries per row, past the 16-token
window), as does a 2-stage pipeline and full activation checkpointing; tensor parallelism is refused
(one shared key=value head) and dist-moe refuses its MoE (hash routing, sqrt-softplus, clamped SwiGLU) by name."""
from __future__ import annotations

import pytest
import torch

import titan_models as tm
from titan_train import load_recipe, train
from titan_train.expert_parallel import use_dist_moe

# no selection-bias update: under pp it does not count the microbatches yet (the trainer refuses it)
DSV4 = {"model.family": "deepseek_v4", "model.moe_impl": "titan", "training.seq_len": "96",
        "training.moe_bias_update_rate": "0"}
STEPS = {"training.steps": "6"}


def test_deepseek_v4_debug_recipe_builds_the_family():
    config = load_recipe("deepseek_v4_debug")
    assert (config.model.family, config.model.flavor, config.model.moe_impl) == ("deepseek_v4", "debug", "titan")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, jobs):
    losses = train(jobs.tiny(tmp_path_factory.mktemp("single"), **DSV4, **STEPS)).losses
    assert losses[6] < losses[1] - 0.5, f"the tiny DeepSeek-V4 job should learn: {losses}"
    return losses


@pytest.mark.parametrize("layout", [{"parallelism.dp_shard": "2"}, {"parallelism.pp": "2"}], ids=["fsdp2", "pp2"])
def test_parallel_layout_follows_single_process(reference, tmp_path, jobs, layout):
    curve = jobs.on_ranks(jobs.tiny(tmp_path, **DSV4, **STEPS, **layout), 2)
    assert sorted(curve) == sorted(reference)
    for step, loss in reference.items():  # tolerance as in test_parallel.py
        assert curve[step] == pytest.approx(loss, rel=1e-4), (step, curve, reference)


def test_dist_moe_refuses_deepseek_v4_moe():
    with torch.device("meta"):
        model = tm.transforms.num_layers(1)(tm.flavor("deepseek_v4", "debug")).build()
    with pytest.raises(ValueError, match="activation, hash_vocab_size, score_func='sqrtsoftplus'"):
        use_dist_moe(model, aux_loss_alpha=0.0)


def test_activation_checkpointing_follows_the_reference(reference, tmp_path, jobs):
    """Every block recomputed in backward (its keyword inputs: ropes, positions, token ids) changes nothing."""
    losses = train(jobs.tiny(tmp_path, **DSV4, **STEPS, **{"activation_checkpoint.mode": "full"})).losses
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), (step, losses, reference)


def test_tensor_parallel_is_refused_naming_the_shared_head(tmp_path, jobs):
    with pytest.raises(Exception, match="does not divide the model's num_kv_heads=1"):  # raised on the ranks
        jobs.on_ranks(jobs.tiny(tmp_path, **DSV4, **STEPS, **{"parallelism.tp": "2"}), 2)

"""DeepSeek-V4 through the trainer: the debug recipe learns on CPU, FSDP on 2 gloo ranks follows the
single-process loss curve (96-token sequences: 6 heavy and 24 sparse entries per row, past the 16-token
window), as does a 2-stage pipeline and full activation checkpointing, and expert parallelism with dist-moe's
layer (hash routing, sqrt-softplus scores, clamped SwiGLU) follows titan-models' MoE in one process, loss and
gradient norm; tensor parallelism is refused (one shared key=value head)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from titan_train_curves import assert_pairs_follow

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
def reference_folder(tmp_path_factory, jobs):
    folder = tmp_path_factory.mktemp("single")
    losses = train(jobs.tiny(folder, **DSV4, **STEPS)).losses
    assert losses[6] < losses[1] - 0.5, f"the tiny DeepSeek-V4 job should learn: {losses}"
    return folder


@pytest.fixture(scope="module")
def reference(reference_folder):
    return {step: loss for step, (loss, _) in curve(reference_folder).items()}


def curve(folder: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad_norm) from metrics.jsonl."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records}


MTP = {**DSV4, "training.steps": "3", "training.seq_len": "32", "model.mtp_layers": "1",
       "training.mtp_loss_weight": "0.3"}
TWO_RANKS = {  # id -> the job of each 2-rank run here
    "fsdp2": {**DSV4, **STEPS, "parallelism.dp_shard": "2"},
    "pp2": {**DSV4, **STEPS, "parallelism.pp": "2"},
    "ep2": {**DSV4, **STEPS, "parallelism.ep": "2", "model.moe_impl": "dist_moe"},
    "mtp_pp2": {**MTP, "parallelism.pp": "2", "parallelism.pp_microbatches": "2"},
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, jobs) -> dict[str, Path]:
    """id -> job folder of each of TWO_RANKS, all trained in one spawn of 2 gloo ranks."""
    root = tmp_path_factory.mktemp("two_ranks")
    return jobs.folders_on_ranks(root, TWO_RANKS, 2)


@pytest.mark.parametrize("layout", ["fsdp2", "pp2"])
def test_parallel_layout_follows_single_process(reference, two_ranks, layout):
    got = {step: loss for step, (loss, _) in curve(two_ranks[layout]).items()}
    assert sorted(got) == sorted(reference)
    for step, loss in reference.items():  # tolerance as in test_parallel.py
        assert got[step] == pytest.approx(loss, rel=1e-4), (step, got, reference)


def test_dist_moe_takes_deepseek_v4_moe_with_its_table_and_clamp():
    with torch.device("meta"):
        model = tm.transforms.num_layers(2)(tm.flavor("deepseek_v4", "debug")).build()
    assert use_dist_moe(model, aux_loss_alpha=0.0) == ["layers.0.moe", "layers.1.moe"]
    hash_layer, topk_layer = model.layers["0"].moe.config, model.layers["1"].moe.config
    assert (hash_layer.hash_vocab_size, topk_layer.hash_vocab_size) == (model.config.vocab_size, None)
    assert hash_layer.score_func == "sqrtsoftplus" and hash_layer.swiglu_limit == topk_layer.swiglu_limit == 10.0


@pytest.mark.parametrize("nproc", [2, 4], ids=["ep2", "ep4"])
def test_expert_parallel_follows_titan_moe_in_one_process(reference_folder, two_ranks, tmp_path, jobs, nproc):
    """dist-moe's layer with the experts over ep ranks (2 or 4 of the 8; hash layer 0 routes by the table,
    layer 1 by sqrt-softplus top-2) against titan-models' MoE in one process. The gradient norm catches a wrong
    expert-gradient scale, which the loss hides (test_expert_parallel.py)."""
    if nproc == 2:  # trained with the other 2-rank runs
        folder = two_ranks["ep2"]
    else:
        folder = tmp_path
        jobs.on_ranks(jobs.tiny(folder, **{**TWO_RANKS["ep2"], "parallelism.ep": "4"}), 4)
    got, want = curve(folder), curve(reference_folder)
    assert sorted(got) == sorted(want)
    assert_pairs_follow(got, want, want)  # the loss and the gradient norm


def test_mtp_in_a_two_stage_pipeline_follows_one_process(two_ranks, tmp_path, jobs):
    """The MTP module on the last stage reads the streams the first stage hands on (with the embeddings of
    tokens i + 1); main and MTP losses follow one process."""
    train(jobs.tiny(tmp_path / "single", **MTP))
    mtp = {}
    for name, folder in (("single", tmp_path / "single"), ("pp2", two_ranks["mtp_pp2"])):
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        mtp[name] = {r["step"]: (r["loss"], r["mtp_loss"]) for r in records}
    assert sorted(mtp["pp2"]) == [1, 2, 3]
    for step, (loss, mtp_loss) in mtp["single"].items():
        assert mtp["pp2"][step] == pytest.approx((loss, mtp_loss), rel=1e-4), (step, mtp)


def test_activation_checkpointing_follows_the_reference(reference, tmp_path, jobs):
    """Every block recomputed in backward (its keyword inputs: ropes, positions, token ids) changes nothing."""
    losses = train(jobs.tiny(tmp_path, **DSV4, **STEPS, **{"activation_checkpoint.mode": "full"})).losses
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), (step, losses, reference)


def test_tensor_parallel_is_refused_naming_the_shared_head(tmp_path, jobs):
    with pytest.raises(Exception, match="does not divide the model's num_kv_heads=1"):  # raised on the ranks
        jobs.on_ranks(jobs.tiny(tmp_path, **DSV4, **STEPS, **{"parallelism.tp": "2"}), 2)

"""Expert parallelism (dist-moe) on gloo ranks follows the single-process loss curve of the same recipe.

References are one process running the same recipe with ep=1. For Qwen3-MoE that process uses
titan-models' own MoE layer (model.moe_impl=auto picks it without ep), an independent implementation
of the routing and the experts; the parallel runs use dist-moe's layer, experts split over ep ranks.

Tolerance: titan_train_curves (relative 1e-4 for steps 1-3 in fp32, for the loss and for the gradient
norm before clipping, then a bound doubling per step for the amplified rounding of sums taken in another
order). The gradient norm is what catches a wrong expert-gradient scale, to which Adam's
update is nearly blind: experts divided by FSDP's group size instead of the data-parallel size (a factor
2 on EP2) moved the step-1 norm by 7e-4. The expert biases after 10 aux-loss-free updates must equal
the single process's exactly: a count not summed over the data-parallel ranks and microbatches, or one
doubled by activation-checkpoint recomputation, changes a sign and with it the bias.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from titan_train_curves import assert_pairs_follow

import dist_moe
import titan_models as tm
from titan_train import TrainConfig, load_recipe, train
from titan_train.cli import main
from titan_train.cli_args import apply_override
from titan_train.expert_parallel import prepare_moe_layers, resolve_moe_impl
from torch_checkpointing import Checkpointer

STEPS = 10
TINY = {"job.device": "cpu", "model.num_layers": "2", "training.seq_len": "64", "training.batch_size": "4",
        "metrics.tensorboard": "false", "metrics.progress": "false", "lr_schedule.warmup_steps": "2",
        "checkpoint.resume": "false",
        "training.steps": str(STEPS)}
SINGLE = {"parallelism.ep": "1", "parallelism.dp_shard": "-1"}
# GPU checks: longer sequences, bf16 against an fp32 reference within bf16's few percent (as test_gpu.py).
GPU = {"job.device": "cuda", "training.steps": "20", "training.seq_len": "256", "training.batch_size": "8"}


def moe_job(recipe: str, folder: Path, **overrides: str) -> TrainConfig:
    config = load_recipe(recipe)
    for name, value in {**TINY, "job.folder": str(folder), **overrides}.items():
        apply_override(config, name, value)
    return config


def curve(folder: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad_norm) from metrics.jsonl (a later line for a step wins: a resumed run)."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records}


def expert_biases(folder: Path, step: int, layers: list[int]) -> dict[str, torch.Tensor]:
    state = {"model": {f"layers.{i}.moe.expert_bias": torch.zeros(8) for i in layers}}
    with Checkpointer(str(folder / "checkpoints")) as checkpoints:
        checkpoints.load(state, step=step)
    return state["model"]


@pytest.fixture(scope="module")
def qwen_reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen_single")
    config = moe_job("qwen3_moe_debug_ep", folder, **SINGLE, **{"checkpoint.interval": "5"})
    assert resolve_moe_impl(config) == "titan"  # the independent implementation
    result = train(config)
    assert result.losses[STEPS] < result.losses[1] - 1.0, f"the tiny MoE job should learn: {result.losses}"
    return folder


LINEAR = {"training.seq_len": "80", "training.steps": "6"}  # 80 tokens: past the 64-token chunk of GDN and KDA
LINEAR_RECIPES = ("qwen3_next_debug_ep", "kimi_linear_debug_ep")


@pytest.fixture(scope="module")
def ep2_runs(tmp_path_factory, jobs) -> dict[str, Path]:
    """name -> folder of the EP2 runs (experts over 2 ranks, dist-moe's layer), all three in one spawn, and of
    the single-process references of the two linear-attention models (titan-models' MoE)."""
    root = tmp_path_factory.mktemp("ep2")
    for recipe in LINEAR_RECIPES:
        single = moe_job(recipe, root / f"{recipe}_single", **SINGLE, **LINEAR)
        assert resolve_moe_impl(single) == "titan"
        train(single)
    ep2 = {"parallelism.ep": "2"}
    jobs.each_on_ranks([
        moe_job("qwen3_moe_debug_ep", root / "qwen3_moe_debug_ep", **ep2, **{"checkpoint.interval": "5"}),
        *(moe_job(recipe, root / recipe, **ep2, **LINEAR) for recipe in LINEAR_RECIPES)], 2)
    return {path.name: path for path in root.iterdir()}


def test_ep2_follows_titan_moe_in_one_process_and_resumes_elsewhere(qwen_reference, ep2_runs, tmp_path):
    folder = ep2_runs["qwen3_moe_debug_ep"]
    want = curve(qwen_reference)
    assert_pairs_follow(curve(folder), want, range(1, STEPS + 1))

    biases, reference_biases = expert_biases(folder, STEPS, [0, 1]), expert_biases(qwen_reference, STEPS, [0, 1])
    for name, bias in biases.items():
        assert bias.abs().sum() > 0, "aux-loss-free balancing moved no bias"
        assert torch.equal(bias, reference_biases[name]), (name, bias, reference_biases[name])

    meta = json.loads((folder / "checkpoints" / "step-5" / "metadata.json").read_text())
    assert "rng.cpu" in meta["per_rank"] and "rng.cpu" not in meta["tensors"]  # each rank's own generator

    # The EP2 checkpoint (experts split over ranks, router gates replicated) resumes in one process with
    # titan-models' MoE and continues the reference curve.
    moved = tmp_path / "moved"
    shutil.copytree(folder / "checkpoints" / "step-5", moved / "checkpoints" / "step-5")
    resumed = train(moe_job("qwen3_moe_debug_ep", moved, **SINGLE, **{"checkpoint.resume": "true"}))
    assert resumed.start_step == 5 and sorted(resumed.losses) == list(range(6, STEPS + 1))
    assert_pairs_follow(curve(moved), want, range(6, STEPS + 1))


@pytest.mark.parametrize("recipe", LINEAR_RECIPES)
def test_ep2_linear_attention_model_follows_titan_moe(ep2_runs, recipe):
    """Qwen3-Next: dist-moe's layer with the sigmoid-gated shared expert (its own dense FSDP unit). Kimi Linear:
    DeepSeek-V3's router and shared expert beside Kimi Delta Attention. Experts over 2 ranks, against
    titan-models' MoE in one process."""
    assert_pairs_follow(curve(ep2_runs[recipe]), curve(ep2_runs[f"{recipe}_single"]), range(1, 7))


DEEPSEEK_ACCUM = {"training.batch_size": "8", "model.moe_aux_loss_weight": "0.01"}


@pytest.fixture(scope="module")
def deepseek_runs(tmp_path_factory, jobs) -> dict[str, Path]:
    """name -> folder: DeepSeek-V3 (a dense first layer, shared experts, group-limited sigmoid routing) in one
    process with dist-moe's layer (titan-models' MoE has no balance loss), and on 4 ranks (experts over ep=2,
    data-parallel over the 2 remaining): FSDP with accumulation, the balance loss and recomputation, and
    flexshard; the two 4-rank runs in one spawn."""
    root = tmp_path_factory.mktemp("deepseek")
    saved = {"model.moe_impl": "dist_moe", "checkpoint.interval": str(STEPS)}
    train(moe_job("deepseek_v3_debug_ep", root / "single_accum", **SINGLE, **DEEPSEEK_ACCUM, **saved))
    train(moe_job("deepseek_v3_debug_ep", root / "single", **SINGLE, **saved))
    ep2 = {"parallelism.ep": "2", "parallelism.dp_shard": "4", "checkpoint.interval": str(STEPS)}
    jobs.each_on_ranks([
        moe_job("deepseek_v3_debug_ep", root / "fsdp4xep2", **DEEPSEEK_ACCUM, **ep2, **{
            "training.grad_accum_steps": "2", "activation_checkpoint.mode": "full"}),
        moe_job("deepseek_v3_debug_ep", root / "flexshard_ep2", **ep2, **{
            "parallelism.fsdp_impl": "flexshard", "parallelism.flexshard_placements": "*.attention.*=owned"})], 4)
    return {path.name: path for path in root.iterdir()}


def test_fsdp4_x_ep2_deepseek_v3_with_accumulation_aux_loss_and_recomputation(deepseek_runs):
    """Experts split over ep=2 and FSDP-sharded over the 2 remaining data-parallel ranks; gradient accumulation
    (the aux loss weight is shared out over microbatches), the sequence-wise balance loss and full activation
    checkpointing (the all-to-all runs again in backward) ride along. The reference has the same global batch
    in one microbatch."""
    folder, reference = deepseek_runs["fsdp4xep2"], deepseek_runs["single_accum"]
    assert_pairs_follow(curve(folder), curve(reference), range(1, STEPS + 1))
    moe_layers = [1]  # layer 0 is dense (first_k_dense=1)
    assert all(torch.equal(a, b) for a, b in zip(expert_biases(folder, STEPS, moe_layers).values(),
                                                 expert_biases(reference, STEPS, moe_layers).values()))


def test_flexshard_x_ep2_deepseek_v3_follows_one_process(deepseek_runs):
    """flexshard for the non-expert parameters (attention, the dense layer, routers, embeddings, row and
    owned placements) while the MoE layers are fully_shard units over their expert-data-parallel mesh,
    experts split over ep=2 on 4 ranks; the expert biases after 10 updates equal the single process's."""
    folder, reference = deepseek_runs["flexshard_ep2"], deepseek_runs["single"]
    assert_pairs_follow(curve(folder), curve(reference), range(1, STEPS + 1))
    assert all(torch.equal(a, b) for a, b in zip(expert_biases(folder, STEPS, [1]).values(),
                                                 expert_biases(reference, STEPS, [1]).values()))


@pytest.mark.parametrize("overrides,message", [
    ({}, "parallelism.ep=2 must divide dp_shard=1"),  # the recipe's ep=2 in one process
    ({"parallelism.ep": "1", "model.moe_impl": "titan", "model.moe_aux_loss_weight": "0.1"},
     "model.moe_aux_loss_weight > 0 needs model.moe_impl=dist_moe"),
    ({"parallelism.ep": "1", "training.moe_bias_update_rate": "-1"}, "training.moe_bias_update_rate must be >= 0"),
    ({"parallelism.ep": "1", "model.moe_impl": "titan", "model.moe_keep_routed_input": "true"},
     "model.moe_keep_routed_input needs model.moe_impl=dist_moe"),
])
def test_moe_settings_that_cannot_run_are_errors(capsys, overrides, message):
    args = [p for k, v in {"checkpoint.resume": "false", **overrides}.items() for p in (f"--{k}", v)]
    assert main(["--recipe", "qwen3_moe_debug_ep", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("keep", [False, True])
def test_keep_routed_input_reaches_every_dist_moe_layer(keep):
    config = load_recipe("qwen3_moe_debug_ep")
    config.model.moe_keep_routed_input = keep
    with torch.device("meta"):
        model = tm.flavor(config.model.family, config.model.flavor).build()
    moes = prepare_moe_layers(model, config)
    assert moes and all(isinstance(m, dist_moe.MoE) and m.config.keep_routed_input is keep for m in moes)


def test_expert_parallel_needs_dist_moe():
    config = load_recipe("qwen3_moe_debug_ep")
    config.model.moe_impl = "titan"
    with pytest.raises(ValueError, match="parallelism.ep=2 needs model.moe_impl=dist_moe"):
        resolve_moe_impl(config)
    # ep x tp with checkpoints and the balance loss compose now (test_expert_parallel_composed.py)
    config.model.moe_impl, config.parallelism.tp, config.checkpoint.interval = "auto", 2, 5
    config.model.moe_aux_loss_weight = 0.1
    assert resolve_moe_impl(config) == "dist_moe"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dist_moe_kernels_train_like_titan_moe(tmp_path):
    """dist-moe's Triton kernels (routing, fused expert MLP) in training on one GPU against titan-models'
    MoE in fp32. (In one process bf16 is autocast, which dist-moe's expert kernels do not follow: they
    run in the weights' fp32; under FSDP they get bf16 weights.)"""
    fp32 = train(moe_job("qwen3_moe_debug_ep", tmp_path / "fp32", **SINGLE, **GPU,
                         **{"training.mixed_precision": "fp32"})).losses
    kernels = train(moe_job("qwen3_moe_debug_ep", tmp_path / "dist_moe", **SINGLE, **GPU,
                            **{"model.moe_impl": "dist_moe", "training.mixed_precision": "bf16"})).losses
    assert kernels[20] < kernels[1] - 1.0
    for step in fp32:
        assert kernels[step] == pytest.approx(fp32[step], rel=5e-2), (step, kernels, fp32)


@pytest.mark.parametrize("nproc,recipe,layout", [
    (2, "qwen3_moe_debug_ep", {}),
    (4, "deepseek_v3_debug_ep", {"parallelism.dp_shard": "4"}),
], ids=["ep2", "fsdp4xep2"])
def test_gpu_expert_parallel_over_nccl_follows_one_gpu(tmp_path, cli, nproc, recipe, layout):
    """The real command under torchrun on nccl: bf16 experts (FSDP's param dtype) on the Triton kernels,
    tokens exchanged with all_to_all, against one GPU in fp32 with titan-models' MoE."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs (expert parallelism over nccl)")
    fp32 = train(moe_job(recipe, tmp_path / "fp32", **SINGLE, **GPU, **{"training.mixed_precision": "fp32"})).losses
    folder = tmp_path / "ep"
    args = {**TINY, **GPU, **layout, "training.mixed_precision": "bf16", "job.folder": str(folder)}
    cli.run(["--recipe", recipe, *(p for k, v in args.items() for p in (f"--{k}", v))], nproc=nproc)
    got = curve(folder)
    assert got[20][0] < got[1][0] - 1.0
    for step in fp32:
        assert got[step][0] == pytest.approx(fp32[step], rel=5e-2), (step, got, fp32)

"""Expert parallelism composed with pipeline and context parallelism (and MTP) on gloo ranks, each
following the single-process loss curve of the same recipe (DeepSeek-V3 debug, 3 layers: a dense first
layer and two MoE layers, so under pp=2 both stages hold MoE layers).

Tolerance and argument as test_expert_parallel.py: relative 1e-4 per step over 10 steps (fp32) for the
loss and the gradient norm; the expert biases after 10 aux-loss-free updates equal the single process's
exactly, which needs the loads counted over every microbatch of the pipeline's schedule on every
stage (a count missed or doubled flips a sign). The references run dist-moe's layer in one process
with the same global batch in one piece. Kill-and-resume of the PP x EP and TP x EP runs gives bitwise
their curves; the TP x EP checkpoint, which must store the expert shards held by both tp ranks once, also
resumes in one process.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from titan_train_curves import assert_pairs_follow
from titan_train_ranks import file_rendezvous, join_gloo, spawn_ranks

from titan_train import TrainConfig, load_recipe, train
from titan_train.cli_args import apply_override
from torch_checkpointing import Checkpointer

STEPS = 10
TINY = {"job.device": "cpu", "training.batch_size": "4", "metrics.tensorboard": "false", "metrics.progress": "false",
        "lr_schedule.warmup_steps": "2", "checkpoint.resume": "false", "training.steps": str(STEPS)}
RECIPE = "deepseek_v3_debug_ep"
MOE_LAYERS = (1, 2)
JOB = {"model.num_layers": "3", "model.moe_impl": "dist_moe", "training.seq_len": "32",
       "checkpoint.interval": str(STEPS), "checkpoint.async_save": "false"}
SINGLE = {"parallelism.ep": "1", "parallelism.dp_shard": "-1"}


def job(folder: Path, **overrides: str) -> TrainConfig:
    config = load_recipe(RECIPE)
    for name, value in {**TINY, **JOB, "job.folder": str(folder), **overrides}.items():
        apply_override(config, name, value)
    return config


def curve(folder: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad_norm) from metrics.jsonl (a later line for a step wins: a resumed run)."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records}


def biases(folder: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    state = {"model": {f"layers.{i}.moe.expert_bias": torch.zeros(8) for i in MOE_LAYERS}}
    with Checkpointer(str(folder / "checkpoints")) as checkpoints:
        checkpoints.load(state, step=step)
    return state["model"]


def assert_same_biases(folder: Path, reference: Path) -> None:
    for (name, bias), want in zip(biases(folder).items(), biases(reference).values()):
        assert bias.abs().sum() > 0, f"{name}: aux-loss-free balancing moved no bias"
        assert torch.equal(bias, want), (name, bias, want)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("single")
    train(job(folder, **SINGLE))
    return folder


PP2_EP2 = {"parallelism.pp": "2", "parallelism.dp_shard": "2", "parallelism.ep": "2",
           "parallelism.pp_microbatches": "2"}
CP2_EP2 = {"parallelism.cp": "2", "parallelism.dp_shard": "2", "parallelism.ep": "2"}
TP2_EP2 = {"parallelism.tp": "2", "parallelism.dp_shard": "2", "parallelism.ep": "2", "checkpoint.interval": "5"}
AUX = {"model.moe_aux_loss_weight": "0.3", "checkpoint.interval": "0"}
RESUMING = {"checkpoint.interval": "5", "checkpoint.resume": "true"}
RUNS = {"pp2xep2": PP2_EP2, "cp2xep2": CP2_EP2, "tp2xep2": TP2_EP2,
        "aux_tp2xep2": {**TP2_EP2, **AUX}, "aux_cp2xep2": {**CP2_EP2, **AUX}}
KILLED = {"killed_pp2xep2": {**PP2_EP2, **RESUMING}, "killed_tp2xep2": {**TP2_EP2, **RESUMING}}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, jobs) -> dict[str, Path]:
    """name -> job folder of every 4-rank run here, in three spawns (starting 4 ranks and importing torch
    costs more than a tiny run): each of KILLED is killed (SIGKILL on every rank) in step 7, after step 5's
    blocking checkpoint; then one spawn trains each of RUNS (TP2 x EP2 checkpointed at steps 5 and 10) and
    resumes both killed runs on 4 ranks."""
    root = tmp_path_factory.mktemp("four_ranks")
    configs = {name: job(root / name, **layout) for name, layout in {**RUNS, **KILLED}.items()}
    for name in KILLED:
        with pytest.raises(mp.ProcessExitedException):
            spawn_ranks(_rank_killed_in_step, 4, (4, file_rendezvous(root), configs[name], 7))
        steps = [json.loads(line)["step"] for line in (root / name / "metrics.jsonl").read_text().splitlines()]
        assert max(steps) == 6, (name, steps)  # killed in step 7
    jobs.each_on_ranks(configs.values(), 4)
    return {name: root / name for name in configs}


def test_pp2_x_ep2_follows_one_process_and_resumes_bitwise_after_a_kill(reference, four_ranks):
    assert_pairs_follow(curve(four_ranks["pp2xep2"]), curve(reference), range(1, STEPS + 1))
    assert_same_biases(four_ranks["pp2xep2"], reference)
    assert curve(four_ranks["killed_pp2xep2"]) == curve(four_ranks["pp2xep2"])  # bitwise: JSON floats round-trip


def test_cp2_x_ep2_follows_one_process(reference, four_ranks):
    assert_pairs_follow(curve(four_ranks["cp2xep2"]), curve(reference), range(1, STEPS + 1))
    assert_same_biases(four_ranks["cp2xep2"], reference)


def test_tp2_x_ep2_follows_one_process_and_saves_each_expert_piece_once(reference, four_ranks):
    """Attention and dense layers tensor-parallel (MLA's latent projections whole on each tp rank, the shared
    rope key's gradient summed over tp), the MoE layers not TP-split: each tp rank routes its own sequence
    shard over the ep group, and their gradients and loads are summed over tp. Both tp ranks hold the same
    expert shards; the checkpoint stores each piece once (one writing rank per expert range, for the weights
    and their moments) and holds the single process's expert biases, once."""
    tp2_x_ep2 = four_ranks["tp2xep2"]
    assert_pairs_follow(curve(tp2_x_ep2), curve(reference), range(1, STEPS + 1))
    assert_same_biases(tp2_x_ep2, reference)
    tensors = _saved_tensors(tp2_x_ep2, STEPS)
    for path in ("model.layers.1.moe.experts.w1", "optimizer.state.layers.2.moe.experts.w2.exp_avg"):
        chunks = tensors[path]["chunks"]
        assert sorted(c["offset"][0] for c in chunks) == [0, 4], (path, chunks)  # 8 experts over ep 2
        assert len({c["rank"] for c in chunks}) == 2, (path, chunks)
    assert len(tensors["model.layers.1.moe.expert_bias"]["chunks"]) == 1


def test_tp2_x_ep2_resumes_bitwise_after_a_kill_and_in_one_process(reference, four_ranks, tmp_path):
    """Killed (SIGKILL on every rank) in step 7, after step 5's checkpoint, and resumed on the same 4 ranks:
    bitwise the uninterrupted run's curve. Its step-5 checkpoint resumed in one process (experts whole, no
    tp) continues the single process's curve within the layout tests' tolerance."""
    tp2_x_ep2 = four_ranks["tp2xep2"]
    assert curve(four_ranks["killed_tp2xep2"]) == curve(tp2_x_ep2)  # bitwise: JSON floats round-trip exactly

    moved = tmp_path / "moved"
    (moved / "checkpoints").mkdir(parents=True)
    shutil.copytree(tp2_x_ep2 / "checkpoints" / "step-5", moved / "checkpoints" / "step-5")
    train(job(moved, **SINGLE, **{"checkpoint.resume": "true", "checkpoint.interval": "0"}))
    resumed = curve(moved)
    assert sorted(resumed) == list(range(6, STEPS + 1))
    assert_pairs_follow(resumed, curve(reference), range(6, STEPS + 1))


def _saved_tensors(folder: Path, step: int) -> dict[str, dict]:
    """The committed step's metadata: path -> dtype, shape and the chunks each rank wrote."""
    return json.loads((folder / "checkpoints" / f"step-{step}" / "metadata.json").read_text())["tensors"]


@pytest.fixture(scope="module")
def aux_reference(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("single_aux")
    train(job(folder, **SINGLE, **AUX))
    return folder


@pytest.mark.parametrize("layout", ["tp2xep2", "cp2xep2"])
def test_ep_with_the_sequence_balance_loss_follows_one_process(aux_reference, four_ranks, layout):
    """DeepSeek-V3's sequence-wise balance loss when each rank's MoE layers see part of every sequence: tp's
    sequence shards (TP2 x EP2) or cp's chunks (CP2 x EP2). The expert counts are summed over those ranks and
    each rank's loss is its tokens' share (dist-moe's sequence_group; times cp, whose gradients are averaged);
    the curve follows the single process's with the same loss weight. (Computed from each rank's tokens
    alone, the loss moved the gradient norm off at step 1 in control runs: 9e-3 for TP2 x EP2, 2.4e-4 for
    CP2 x EP2.)"""
    assert_pairs_follow(curve(four_ranks[f"aux_{layout}"]), curve(aux_reference), range(1, STEPS + 1))


@pytest.mark.parametrize("overrides,message", [
    ({"parallelism.ep": "1", "model.moe_impl": "titan", "model.moe_routing": "forced_balance"},
     "forced_balance needs model.moe_impl=dist_moe"),
])
def test_degrees_that_cannot_compose_are_errors(overrides, message):
    from titan_train.expert_parallel import resolve_moe_impl

    with pytest.raises(ValueError, match=message):
        resolve_moe_impl(job(Path("unused"), **overrides))


def test_forced_balance_routing_is_labelled_in_every_record(reference, tmp_path):
    folder = tmp_path / "forced"
    train(job(folder, **SINGLE, **{"model.moe_routing": "forced_balance", "training.steps": "2",
                                   "checkpoint.interval": "0"}))
    assert all(r["moe_routing"] == "forced_balance" for r in _records(folder).values())
    assert not any("moe_routing" in r for r in _records(reference).values())  # learned routing: unlabelled


def _rank_killed_in_step(rank: int, world: int, init_method: str, config: TrainConfig, kill_at: int) -> None:
    """A rank of `config` that SIGKILLs itself when step `kill_at` begins (no cleanup, as a lost node)."""
    from titan_train.trainer import Trainer

    join_gloo(rank, world, init_method)
    step = Trainer.train_step

    def train_step(self, n: int):
        if n == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self, n)

    Trainer.train_step = train_step
    train(config)


@pytest.mark.timeout(240)
def test_pp2_x_dp2_x_ep2_with_mtp_follows_one_process(tmp_path, jobs):
    """The MLPerf shape in miniature (8 ranks): pipeline 2, data parallel 2 with its experts split over ep 2,
    one MTP module on the last stage, its input embeddings handed on by the first. Kept to 10 tiny steps:
    about a minute on 2 cores."""
    mtp = {"model.mtp_layers": "1", "training.mtp_loss_weight": "0.3", "model.num_layers": "2",
           "training.seq_len": "16", "training.batch_size": "8", "checkpoint.interval": "0"}
    reference = tmp_path / "single"
    train(job(reference, **SINGLE, **mtp))
    folder = tmp_path / "pp2xdp2xep2"
    jobs.on_ranks(job(folder, **mtp, **{"parallelism.pp": "2", "parallelism.dp_shard": "4", "parallelism.ep": "2",
                                         "parallelism.pp_microbatches": "2"}), 8)
    got, want = _records(folder), _records(reference)
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "mtp_loss"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4), (key, step, got[step], want[step])


def _records(folder: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("gpus,dp_shard,rows", [(256, 128, 8), (512, 256, 4)])
def test_mlperf_recipe_degrees_on_256_and_512_gpus(gpus, dp_shard, rows):
    """The README's table: pp 2 x dp with ep 64 inside dp; 512 GPUs keep the global batch (1024 x 4096),
    so each data-parallel rank takes half the rows (pp_microbatches 4 there)."""
    from titan_train.mesh import resolve_degrees
    from titan_train.pipeline import check_pipeline

    config = load_recipe("deepseek_v3_mlperf")
    if gpus == 512:
        config.parallelism.pp_microbatches = 4
    degrees = resolve_degrees(config.parallelism, gpus)
    assert (degrees.pp, degrees.dp_shard, degrees.ep, degrees.tp) == (2, dp_shard, 64, 1)
    assert config.training.batch_size // degrees.dp == rows
    settings = check_pipeline(config.parallelism, pp=2, rows=rows, grad_accum_steps=1, compiled=False)
    assert rows // settings.microbatches == 1  # one sequence of 4096 tokens per microbatch

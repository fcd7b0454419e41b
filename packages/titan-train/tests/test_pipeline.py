"""Pipeline parallelism: the stage layout, the recipe checks, and runs on gloo ranks that follow the
single-process loss curve of the same job; a pipeline checkpoint resumes in its layout and in one process.

Tolerance: relative 1e-4 per step over 10 steps in fp32, the bound of test_parallel.py and for the same
reasons. The stages start from bit-identical weights and see the same global batches; what changes is
the order of floating-point sums (the loss and gradients accumulated microbatch by microbatch, the
gradient norm as a sum of per-stage squares, FSDP's reduce-scatter), a relative error near 1e-7 per
operation that ten Adam steps leave near 1e-6 (the largest seen: 4e-7). A real bug — a microbatch's loss
counted twice, gradients divided by the microbatch count, a stage left out of the clipping norm or the
update, layers run out of order — moves the loss by 1e-2 or more within a few steps.
"""
from __future__ import annotations

import dataclasses
import shutil
import typing

import pytest
import torch
from titan_train_curves import assert_follows
from torch.distributed.pipelining import PipelineStage

import titan_models as tm
from titan_train import ParallelismConfig, train
from titan_train.pipeline import SCHEDULES, check_pipeline, keep_rank_part, plan_layout

STEPS = {"training.steps": "10"}


def _meta_llama(num_layers: int):
    config = tm.transforms.num_layers(num_layers)(tm.flavor("llama3", "debug"))
    with torch.device("meta"):
        return config.build()


def _names(layout):
    return [list(stage) for stage in layout.stages]


def test_layout_cuts_evenly_where_the_plan_allows():
    model = _meta_llama(4)
    one = plan_layout(model, pp=2, schedule="1F1B", stages_per_rank=1)
    assert _names(one) == [["0", "1"], ["2", "3"]] and one.ranks == (0, 1)
    looped = plan_layout(model, pp=2, schedule="Interleaved1F1B", stages_per_rank=2)
    assert _names(looped) == [["0"], ["1"], ["2"], ["3"]] and looped.ranks == (0, 1, 0, 1)
    v = plan_layout(model, pp=2, schedule="ZBVZeroBubble", stages_per_rank=2)
    assert v.ranks == (0, 1, 1, 0)  # rank 0 holds the first and the last stage
    five = plan_layout(_meta_llama(5), pp=2, schedule="1F1B", stages_per_rank=1)
    assert _names(five) == [["0", "1"], ["2", "3", "4"]]
    # Only where the plan allows: a single allowed cut before layer 3.
    model.parallel_plan = dataclasses.replace(model.parallel_plan, pipeline_cut_points=("layers.3",))
    assert _names(plan_layout(model, pp=2, schedule="1F1B", stages_per_rank=1)) == [["0", "1", "2"], ["3"]]
    with pytest.raises(ValueError, match="allows no pipeline cut for stage 1 of 3"):
        plan_layout(model, pp=3, schedule="1F1B", stages_per_rank=1)
    with pytest.raises(ValueError, match="at least one block per stage: pp=2 x 3 stages per rank = 6 stages"):
        plan_layout(_meta_llama(4), pp=2, schedule="Interleaved1F1B", stages_per_rank=3)


def test_a_rank_keeps_its_stages_under_their_own_names():
    model = _meta_llama(4)
    layout = plan_layout(model, pp=2, schedule="Interleaved1F1B", stages_per_rank=2)
    keep_rank_part(model, layout, 1)  # stages 1 and 3: layers 1 and 3, the final norm and output
    assert list(model.layers.keys()) == ["1", "3"] and model.tok_embeddings is None
    assert model.norm is not None and model.output is not None
    assert layout.parameter_order[0] == "tok_embeddings.weight" and layout.parameter_order[-1] == "output.weight"
    with torch.device("meta"):
        tied = dataclasses.replace(tm.flavor("llama3", "debug"), tie_embeddings=True).build()
    with pytest.raises(ValueError, match="tied embeddings"):
        keep_rank_part(tied, plan_layout(tied, pp=2, schedule="1F1B", stages_per_rank=1), 0)


@pytest.mark.parametrize("fields,kwargs,message", [
    ({"pp_schedule": "1F1B", "pp_stages_per_rank": 2}, {}, "runs one stage per rank"),
    ({"pp_schedule": "ZBVZeroBubble", "pp_stages_per_rank": 3}, {}, "exactly two stages per rank"),
    ({"pp_microbatches": 3}, {}, "must divide the sequences each data-parallel rank takes"),
    ({"pp_microbatches": 1}, {}, "needs at least pp=2 microbatches"),
    ({"pp_schedule": "Interleaved1F1B", "pp_microbatches": 3}, {"rows": 12}, "multiple of pp=2"),
    ({"pp_microbatches": -1}, {}, "pp_microbatches must be >= 0"),
    ({}, {"grad_accum_steps": 2}, "set parallelism.pp_microbatches instead"),
    ({"pp_schedule": "InterleavedZeroBubble"}, {"compiled": True}, "compiled stages"),
    ({"fsdp_impl": "flexshard"}, {}, "fsdp_impl=flexshard is not supported with pipeline parallelism"),
])
def test_pipeline_fields_are_checked(fields, kwargs, message):
    config = ParallelismConfig(pp=2, **fields)
    with pytest.raises(ValueError, match=message):
        check_pipeline(config, pp=2, **{"rows": 4, "grad_accum_steps": 1, "compiled": False, **kwargs})


def test_pipeline_defaults():
    settings = check_pipeline(ParallelismConfig(pp=2, pp_schedule="Interleaved1F1B"), pp=2, rows=8,
                              grad_accum_steps=1, compiled=False)
    assert (settings.stages_per_rank, settings.microbatches) == (2, 4)  # one microbatch per stage
    # --help lists exactly the schedules the pipeline knows
    assert set(typing.get_args(typing.get_type_hints(ParallelismConfig)["pp_schedule"])) == set(SCHEDULES)


@pytest.fixture(scope="module")
def references(tmp_path_factory, jobs):
    """The single-process curves of the tiny job with (layers, batch size) as the parallel runs."""
    curves = {}
    for layers, batch in (("2", "4"), ("4", "4"), ("4", "8")):
        job = {**STEPS, "model.num_layers": layers, "training.batch_size": batch}
        curves[layers, batch] = train(jobs.tiny(tmp_path_factory.mktemp(f"single{layers}x{batch}"), **job)).losses
    return curves


V_ON_GLOO = hasattr(PipelineStage, "_is_same_rank")  # older pipelining sends to its own rank at the V's turn
LAYOUTS = {  # id -> (ranks, overrides)
    "pp2-1f1b": (2, {"parallelism.pp": "2"}),
    "pp2-interleaved1f1b": (2, {"parallelism.pp": "2", "parallelism.pp_schedule": "Interleaved1F1B",
                                "model.num_layers": "4"}),
    "pp2-interleaved-zero-bubble": (2, {"parallelism.pp": "2", "parallelism.pp_schedule": "InterleavedZeroBubble",
                                        "model.num_layers": "4", "parallelism.pp_microbatches": "4"}),
    "pp2-zbv": (2, {"parallelism.pp": "2", "parallelism.pp_schedule": "ZBVZeroBubble", "model.num_layers": "4"}),
    "pp2xfsdp2": (4, {"parallelism.pp": "2", "parallelism.dp_shard": "2"}),
    # Zero bubble under FSDP: the last stage runs its whole backward at once (see Pipeline.finish).
    "pp2xfsdp2-zero-bubble": (4, {"parallelism.pp": "2", "parallelism.dp_shard": "2", "model.num_layers": "4",
                                  "parallelism.pp_schedule": "InterleavedZeroBubble", "training.batch_size": "8"}),
    # The last stage's loss is the vocabulary-parallel CausalLMLoss under tensor parallelism.
    "pp2xtp2": (4, {"parallelism.pp": "2", "parallelism.tp": "2"}),
}


def linear_attention_job(family: str) -> dict[str, str]:
    job = {**STEPS, "model.family": family, "model.flavor": "debug", "model.vocab_size": "384",
           "training.seq_len": "80"}
    if family == "kimi_linear":  # its MoE's expert-bias update does not count pipeline microbatches yet
        job["training.moe_bias_update_rate"] = "0"
    return job


@pytest.fixture(scope="module")
def pipeline_curves(tmp_path_factory, jobs) -> dict[str, dict[int, float]]:
    """id -> loss curve of each of LAYOUTS (pp2-zbv only where this torch runs V schedules on gloo) and of the
    linear-attention models on pp=2 (pp2-FAMILY); the runs of one rank count in one spawn."""
    root = tmp_path_factory.mktemp("pipeline")
    layouts = {name: (n, {**STEPS, **layout}) for name, (n, layout) in LAYOUTS.items()
               if name != "pp2-zbv" or V_ON_GLOO}
    layouts.update({f"pp2-{family}": (2, {**linear_attention_job(family), "parallelism.pp": "2"})
                    for family in ("qwen3_5", "kimi_linear")})
    curves = {}
    for nproc in (2, 4):
        names = [name for name, (n, _) in layouts.items() if n == nproc]
        configs = [jobs.tiny(root / name, **layouts[name][1]) for name in names]
        curves.update(zip(names, jobs.each_on_ranks(configs, nproc)))
    return curves


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.skipif(not V_ON_GLOO, reason="this torch's V schedules need NCCL"))
    if name == "pp2-zbv" else name for name in LAYOUTS])
def test_pipeline_follows_single_process(references, pipeline_curves, name):
    layout = LAYOUTS[name][1]
    expected = references[(layout.get("model.num_layers", "2"), layout.get("training.batch_size", "4"))]
    assert_follows(pipeline_curves[name], expected)


def test_pipeline_checkpoint_resumes_in_its_layout_and_in_one_process(tmp_path, jobs):
    """PP2 saves at step 3; resuming on PP2, and in one process from a copy, continues the single-process
    curve (constant schedule, so the shorter first run changes nothing else)."""
    job = {"lr_schedule.kind": "constant", "checkpoint.interval": "3", "checkpoint.resume": "true"}
    reference = train(jobs.tiny(tmp_path / "single", **job, **{"training.steps": "6"})).losses
    folder = tmp_path / "pp"
    pp = {"parallelism.pp": "2"}
    jobs.on_ranks(jobs.tiny(folder, **job, **pp, **{"training.steps": "3"}), 2)
    shutil.copytree(folder, tmp_path / "moved")
    curve = jobs.on_ranks(jobs.tiny(folder, **job, **pp, **{"training.steps": "6"}), 2)
    moved = train(jobs.tiny(tmp_path / "moved", **job, **{"training.steps": "6"}))
    assert moved.start_step == 3 and sorted(moved.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert curve[step] == pytest.approx(reference[step], rel=1e-4)
        assert moved.losses[step] == pytest.approx(reference[step], rel=1e-4)


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_pipeline_follows_single_process_for_a_linear_attention_model(tmp_path, jobs, pipeline_curves, family):
    # The debug model, 2 layers cut at the family's declared point: a Gated DeltaNet (Kimi: KDA) stage, then
    # an attention stage (positions and context cross the cut; the linear attention ignores RoPE).
    expected = train(jobs.tiny(tmp_path / "single", **linear_attention_job(family))).losses
    assert_follows(pipeline_curves[f"pp2-{family}"], expected)

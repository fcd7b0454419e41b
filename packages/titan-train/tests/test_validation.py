"""Validation: the eval loss the trainer logs equals a direct forward + cross-entropy over the same
batches with the final weights, and FSDP on 2 gloo ranks logs the eval loss of one process."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

import titan_models as tm
from titan_train.data import ByteTokenizer, PackedLoader, open_documents
from titan_train.trainer import Trainer

VALIDATION = {"validation.interval": "2", "validation.steps": "3", "training.steps": "4"}


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "held_out.jsonl"
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}  # held out\n" * (1 + i % 3)})
             for i in range(40)]
    path.write_text("\n".join(lines) + "\n")
    return path


def records(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_eval_loss_is_the_cross_entropy_of_a_direct_forward(tmp_path, jobs, held_out):
    config = jobs.tiny(tmp_path / "job", **VALIDATION, **{"validation.source": str(held_out)})
    trainer = Trainer(config, torch.device("cpu"))
    result = trainer.run()
    assert sorted(result.eval_losses) == [2, 4]
    logged = {r["step"]: r for r in records(tmp_path / "job") if "eval_loss" in r}
    assert sorted(logged) == [2, 4]
    assert logged[4]["eval_perplexity"] == pytest.approx(math.exp(logged[4]["eval_loss"]), rel=1e-12)

    # By hand, with the weights after step 4: the first 3 batches of the file in order, logits in full.
    loader = PackedLoader(open_documents(str(held_out)), ByteTokenizer(), seq_len=64, shuffle=False)
    total, count = 0.0, 0
    with torch.no_grad():
        for _ in range(3):
            batch = loader.next_batch(4)
            logits = trainer.model(batch.tokens, context=tm.AttentionContext(document_ids=batch.document_ids))
            total += F.cross_entropy(logits.double().flatten(0, 1), batch.labels.flatten(), ignore_index=-100,
                                     reduction="sum").item()
            count += int((batch.labels != -100).sum())
    assert logged[4]["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert logged[2]["eval_loss"] != pytest.approx(logged[4]["eval_loss"], rel=1e-3)  # the model moved


V_ON_GLOO = hasattr(PipelineStage, "_is_same_rank")  # older pipelining sends to its own rank at the V's turn
TWO_RANKS = {  # id -> (job, parallelism) of each 2-rank run; all but FSDP's evaluate at the end only
    "fsdp": ({}, {"parallelism.dp_shard": "2"}),
    "pp": ({"validation.interval": "0"}, {"parallelism.pp": "2"}),
    "dualpipev": ({"validation.interval": "0", "model.num_layers": "4"},
                  {"parallelism.pp": "2", "parallelism.pp_schedule": "DualPipeV", "parallelism.pp_microbatches": "4"}),
    "tp2": ({"validation.interval": "0"}, {"parallelism.tp": "2"}),
    "cp2": ({"validation.interval": "0"}, {"parallelism.cp": "2"}),
}


def job_of(name: str, held_out) -> dict[str, str]:
    return {**VALIDATION, "validation.source": str(held_out), **TWO_RANKS[name][0]}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, jobs, held_out) -> dict[str, dict[int, float]]:
    """id -> step -> eval loss logged by each of TWO_RANKS (dualpipev only where this torch runs V schedules on
    gloo), all trained in one spawn of 2 gloo ranks."""
    root = tmp_path_factory.mktemp("two_ranks")
    names = [name for name in TWO_RANKS if name != "dualpipev" or V_ON_GLOO]
    jobs.each_on_ranks([jobs.tiny(root / name, **job_of(name, held_out), **TWO_RANKS[name][1]) for name in names], 2)
    return {name: {r["step"]: r["eval_loss"] for r in records(root / name) if "eval_loss" in r} for name in names}


def single_eval_losses(tmp_path, jobs, held_out, name: str) -> dict[int, float]:
    return Trainer(jobs.tiny(tmp_path / "single", **job_of(name, held_out)), torch.device("cpu")).run().eval_losses


def test_fsdp_on_two_ranks_logs_the_eval_loss_of_one_process(tmp_path, jobs, held_out, two_ranks):
    single, logged = single_eval_losses(tmp_path, jobs, held_out, "fsdp"), two_ranks["fsdp"]
    assert sorted(logged) == sorted(single)
    for step, loss in single.items():
        assert logged[step] == pytest.approx(loss, rel=1e-4)  # test_parallel.py's tolerance


def test_pipeline_last_stage_computes_the_eval_loss(tmp_path, jobs, held_out, two_ranks):
    single, logged = single_eval_losses(tmp_path, jobs, held_out, "pp"), two_ranks["pp"]
    assert sorted(logged) == [4] == sorted(single)
    assert logged[4] == pytest.approx(single[4], rel=1e-4)


@pytest.mark.skipif(not V_ON_GLOO, reason="this torch's V schedules need NCCL")
def test_dualpipev_computes_the_eval_loss(tmp_path, jobs, held_out, two_ranks):
    """The V schedules' evaluation skips their backward actions (torch's runtime would hand a gradient
    between the rank's two stages at the V's turn, and assert)."""
    single, logged = single_eval_losses(tmp_path, jobs, held_out, "dualpipev"), two_ranks["dualpipev"]
    assert sorted(logged) == [4] == sorted(single)
    assert logged[4] == pytest.approx(single[4], rel=1e-4)


@pytest.mark.parametrize("layout", ["tp2", "cp2"])
def test_tensor_and_context_parallel_log_the_eval_loss_of_one_process(tmp_path, jobs, held_out, two_ranks, layout):
    single = single_eval_losses(tmp_path, jobs, held_out, layout)
    assert two_ranks[layout][4] == pytest.approx(single[4], rel=1e-4)


def test_eval_values_reach_tensorboard(tmp_path, jobs, held_out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = {**VALIDATION, "validation.source": str(held_out), "metrics.tensorboard": "true"}
    result = Trainer(jobs.tiny(tmp_path, **job), torch.device("cpu")).run()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("eval_loss")}
    assert logged == pytest.approx(result.eval_losses, rel=1e-6)  # TensorBoard stores float32
    assert [e.step for e in events.Scalars("eval_perplexity")] == [2, 4]

"""The jobs of issue 24 under parallel layouts on gloo ranks: export_hf_at_end gathers an FSDP run's
weights, `titan-train export` reads a pipeline run's checkpoint, LoRA under pipeline parallelism."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from titan_train import train
from titan_train.export import export_job

JOB = {"training.steps": "3", "lr_schedule.kind": "constant"}
TOKENS = torch.randint(0, 259, (2, 96), generator=torch.Generator().manual_seed(1))


def logits(folder) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.fixture(scope="module")
def single(tmp_path_factory, jobs):
    folder = tmp_path_factory.mktemp("single")
    train(jobs.tiny(folder, **JOB, **{"checkpoint.export_hf_at_end": "true", "checkpoint.interval": "3"}))
    return logits(folder / "hf")


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= 1e-4 * b.abs().max())  # test_parallel.py's tolerance, on logits


LORA = {**JOB, "lora.targets": "layers.*.attention.wq,layers.*.feed_forward.w2", "optimizer.lr": "1e-2"}
TWO_RANKS = {  # id -> job of each 2-rank run, all in one spawn
    "fsdp_export": {**JOB, "checkpoint.export_hf_at_end": "true", "parallelism.dp_shard": "2"},
    "pp": {**JOB, "checkpoint.interval": "3", "parallelism.pp": "2"},
    "lora_pp": {**LORA, "parallelism.pp": "2"},
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, jobs):
    """id -> job folder of each of TWO_RANKS, all trained in one spawn of 2 gloo ranks."""
    root = tmp_path_factory.mktemp("two_ranks")
    return jobs.folders_on_ranks(root, TWO_RANKS, 2)


def test_fsdp_export_at_end_equals_the_single_process_export(two_ranks, single):
    assert close(logits(two_ranks["fsdp_export"] / "hf"), single)


def test_export_of_a_pipeline_checkpoint(tmp_path, two_ranks, single):
    export_job(two_ranks["pp"], tmp_path / "hf")
    assert close(logits(tmp_path / "hf"), single)


def test_lora_under_pipeline_parallelism_follows_one_process(tmp_path, jobs, two_ranks):
    expected = train(jobs.tiny(tmp_path / "single", **LORA)).losses
    records = map(json.loads, (two_ranks["lora_pp"] / "metrics.jsonl").read_text().splitlines())
    curve = {r["step"]: r["loss"] for r in records}
    for step, loss in expected.items():
        assert curve[step] == pytest.approx(loss, rel=1e-4)
    frozen = train(jobs.tiny(tmp_path / "frozen", **{**LORA, "optimizer.lr": "0"})).losses
    assert abs(frozen[3] - expected[3]) > 1e-3  # the adapters did move the loss the pipeline reproduces

"""Checkpoint use: `titan-train export` writes a folder transformers loads with the trained logits; a
missing step is named and nothing is written; initial_load (titan or HF), load_step and exclude."""
from __future__ import annotations

import hashlib

import pytest
import torch
import transformers

from titan_train import train
from titan_train.cli import main
from titan_train.trainer import Trainer

JOB = {"training.steps": "4", "checkpoint.interval": "2", "checkpoint.keep_last": "0", "lr_schedule.kind": "constant"}


def digest(folder) -> str:
    """Every file under `folder`: names, sizes and bytes."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, jobs):
    folder = tmp_path_factory.mktemp("job")
    trainer = Trainer(jobs.tiny(folder, **JOB), torch.device("cpu"))
    trainer.run()
    return folder, trainer.model


def test_export_is_loaded_by_transformers_with_equal_logits(trained, tmp_path, capsys):
    folder, model = trained
    assert main(["export", "--job.folder", str(folder), "--out", str(tmp_path / "hf")]) == 0
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def main():\n    return sorted(items, key=len)  # longest last\n" * 2
    tokens = torch.tensor([tokenizer(text)["input_ids"]])
    assert tokens.shape[1] > 64 and tokens.max() < 256  # the byte tokenizer's ids through transformers
    with torch.no_grad():
        expected, got = model(tokens), hf(input_ids=tokens).logits
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()

    # --step 2: the earlier weights, which differ
    assert main(["export", "--job.folder", str(folder), "--step", "2", "--out", str(tmp_path / "hf2")]) == 0
    early = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (early(input_ids=tokens).logits - expected).abs().max() > 1e-3


def test_export_of_a_missing_step_is_named_and_touches_nothing(trained, tmp_path, capsys):
    folder, _ = trained
    before = digest(folder)
    assert main(["export", "--job.folder", str(folder), "--step", "3", "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "step 3 is not a committed checkpoint" in err and "committed steps: 2, 4" in err
    assert not (tmp_path / "hf").exists() and digest(folder) == before
    assert main(["export", "--job.folder", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    assert "no train_config.json" in capsys.readouterr().err


def test_initial_load_from_a_titan_checkpoint_or_its_hf_export(trained, tmp_path, jobs):
    folder, _ = trained
    main(["export", "--job.folder", str(folder), "--out", str(tmp_path / "hf")])
    job = {"training.steps": "1", "checkpoint.interval": "0", "lr_schedule.kind": "constant"}
    from_titan = train(jobs.tiny(tmp_path / "a", **job, **{"checkpoint.initial_load": str(folder)})).losses[1]
    from_hf = train(jobs.tiny(tmp_path / "b", **job, **{"checkpoint.initial_load": str(tmp_path / "hf")})).losses[1]
    fresh = train(jobs.tiny(tmp_path / "c", **job)).losses[1]
    assert from_titan == from_hf  # the same weights, bitwise, from either format
    assert abs(from_titan - fresh) > 0.1  # the trained weights, not a fresh initialisation


def test_load_step_and_exclude(trained, tmp_path, jobs):
    folder, _ = trained
    whole = train(jobs.tiny(tmp_path / "whole", **{**JOB, "checkpoint.interval": "0"})).losses
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    with pytest.raises(ValueError, match=r"load_step=2 with later checkpoints \[4\].*would save over them"):
        train(jobs.tiny(copy, **JOB, **{"checkpoint.resume": "true", "checkpoint.load_step": "2"}))
    JOB_NO_SAVE = {**JOB, "checkpoint.interval": "0"}
    resumed = train(jobs.tiny(copy, **JOB_NO_SAVE, **{"checkpoint.resume": "true", "checkpoint.load_step": "2"}))
    assert resumed.start_step == 2 and resumed.losses == {3: whole[3], 4: whole[4]}  # step 2, not the newest (4)
    with pytest.raises(ValueError, match="checkpoint.load_step=3 is not a committed checkpoint"):
        train(jobs.tiny(copy, **JOB_NO_SAVE, **{"checkpoint.resume": "true", "checkpoint.load_step": "3"}))
    # exclude the optimizer (and the schedule): the weights and data position of step 2, fresh Adam moments
    fresh_optimizer = train(jobs.tiny(copy, **JOB_NO_SAVE, **{"checkpoint.resume": "true", "checkpoint.load_step": "2",
                                                      "checkpoint.exclude": "optimizer,scheduler"}))
    # step 3 scores the same weights; its update (fresh moments: a full-size first Adam step) differs
    assert fresh_optimizer.losses[3] == whole[3] and fresh_optimizer.losses[4] != whole[4]
    with pytest.raises(ValueError, match="checkpoint.exclude: 'optimiser' matches no checkpoint entry"):
        train(jobs.tiny(copy, **{"checkpoint.exclude": "optimiser"}))

"""LoRA: only the adapters change while training, checkpoints hold them alone, the merged export gives
the adapted model's logits, and FSDP on 2 gloo ranks follows the single-process curve."""
from __future__ import annotations

import pytest
import torch

from titan_train.export import export_job, load_model
from titan_train.lora import LoRALinear
from titan_train.saved_config import load_config
from titan_train.trainer import Trainer
from torch_checkpointing import Checkpointer

LORA = {"lora.targets": "layers.*.attention.wq,layers.*.attention.wv,layers.*.feed_forward.w2", "lora.rank": "4",
        "training.steps": "4", "optimizer.lr": "1e-2", "lr_schedule.kind": "constant"}


def test_only_adapters_change_and_are_checkpointed(tmp_path, jobs):
    trainer = Trainer(jobs.tiny(tmp_path, **LORA, **{"checkpoint.interval": "4"}), torch.device("cpu"))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    adapted = [name for name, m in trainer.model.named_modules() if isinstance(m, LoRALinear)]
    assert len(adapted) == 6 and all(before[f"{n}.lora_b"].count_nonzero() == 0 for n in adapted)
    result = trainer.run()
    assert result.losses[4] < result.losses[1]
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == {f"{n}.lora_{ab}" for n in adapted for ab in "ab"}
    with Checkpointer(str(tmp_path / "checkpoints")) as checkpoints:
        assert checkpoints.steps() == [4]
    saved = _saved_model_names(tmp_path / "checkpoints")
    assert saved == {f"model.{n}.lora_{ab}" for n in adapted for ab in "ab"}


def _saved_model_names(folder) -> set[str]:
    """The model tensors a committed step's data file holds (a safetensors file)."""
    from safetensors import safe_open

    (data,) = folder.glob("step-*/rank-*.safetensors")
    with safe_open(str(data), framework="pt") as f:
        return {name for name in f.keys() if name.startswith("model.")}


def test_merged_export_gives_the_adapted_models_logits(tmp_path, jobs):
    trainer = Trainer(jobs.tiny(tmp_path / "job", **LORA, **{"checkpoint.interval": "4"}), torch.device("cpu"))
    trainer.run()
    export_job(tmp_path / "job", tmp_path / "hf")
    import transformers

    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 259, (2, 80), generator=torch.Generator().manual_seed(0))
    trainer.model.eval()  # no adapter dropout
    with torch.no_grad():
        adapted = trainer.model(tokens)
        reloaded = load_model(load_config(tmp_path / "job"), tmp_path / "job", 4).eval()(tokens)  # base + adapters
        exported = merged(input_ids=tokens).logits
    assert torch.allclose(reloaded, adapted, rtol=0, atol=0)
    assert (exported - adapted).abs().max() <= 1e-5 * adapted.abs().max()
    base = Trainer(jobs.tiny(tmp_path / "base", **{k: v for k, v in LORA.items() if not k.startswith("lora")}),
                   torch.device("cpu")).model.eval()  # the same initial weights, no adapters: they mattered
    with torch.no_grad():
        assert (base(tokens) - adapted).abs().max() > 1e-3


def test_lora_with_fsdp_on_two_ranks_follows_one_process(tmp_path, jobs):
    single = Trainer(jobs.tiny(tmp_path / "single", **LORA), torch.device("cpu")).run().losses
    curve = jobs.on_ranks(jobs.tiny(tmp_path / "fsdp", **LORA, **{"parallelism.dp_shard": "2"}), 2)
    assert sorted(curve) == sorted(single)
    for step, loss in single.items():
        assert curve[step] == pytest.approx(loss, rel=1e-4)


def test_resume_from_adapter_only_checkpoints_matches_the_unbroken_run(tmp_path, jobs):
    """The checkpoint holds the adapters alone: a resume rebuilds the frozen base from the initial weights
    and continues bitwise (adapter dropout on: its draws resume with the RNG state)."""
    job = {**LORA, "training.steps": "5", "checkpoint.interval": "2", "checkpoint.resume": "true",
           "lora.dropout": "0.1"}
    unbroken = Trainer(jobs.tiny(tmp_path / "whole", **job), torch.device("cpu")).run().losses
    Trainer(jobs.tiny(tmp_path / "broken", **{**job, "training.steps": "2"}), torch.device("cpu")).run()
    resumed = Trainer(jobs.tiny(tmp_path / "broken", **job), torch.device("cpu")).run()
    assert resumed.start_step == 2 and resumed.losses == {s: unbroken[s] for s in (3, 4, 5)}


def test_lora_starts_from_a_plain_runs_weights(tmp_path, jobs):
    """initial_load of a plain run's checkpoint into a LoRA run: the base takes those weights, B = 0 adds
    exactly nothing, so the first loss is bitwise that of a plain run started from the same checkpoint."""
    from titan_train import train

    train(jobs.tiny(tmp_path / "plain", **{"training.steps": "2", "checkpoint.interval": "2"}))
    start = {"training.steps": "1", "checkpoint.initial_load": str(tmp_path / "plain")}
    plain = train(jobs.tiny(tmp_path / "a", **start)).losses[1]
    adapted = train(jobs.tiny(tmp_path / "b", **start, **{"lora.targets": LORA["lora.targets"]})).losses[1]
    fresh = train(jobs.tiny(tmp_path / "c", **{"training.steps": "1", "lora.targets": LORA["lora.targets"]})).losses[1]
    assert adapted == plain and abs(fresh - plain) > 0.05

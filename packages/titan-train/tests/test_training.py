"""One-process training: metrics and TensorBoard files, progress line, activation checkpointing and
gradient accumulation leave the loss curve unchanged."""
from __future__ import annotations

import io
import json

import pytest

from titan_train import train
from titan_train.progress import ProgressBar


def test_metrics_and_tensorboard_files(tmp_path, jobs):
    result = train(jobs.tiny(tmp_path, **{"training.steps": "3", "metrics.tensorboard": "true"}))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert {"step", "loss", "tokens_per_s", "lr", "grad_norm", "mfu", "memory_gib"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["memory_gib"] > 0
        assert r["mfu"] is None  # no known peak for a CPU
    assert [r["loss"] for r in records] == [result.losses[s] for s in (1, 2, 3)]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_progress_line_shows_step_loss_throughput_mfu_memory():
    out = io.StringIO()
    bar = ProgressBar(10, stream=out)
    bar.update(4, loss=2.5, tokens_per_s=12345.0, mfu=0.42, memory_gib=1.5)
    line = out.getvalue()
    for text in ("step 4/10", "loss 2.5000", "12.3k tok/s", "MFU 42.0%", "mem 1.50 GiB"):
        assert text in line


@pytest.fixture(scope="module")
def plain(tmp_path_factory, jobs):
    return train(jobs.tiny(tmp_path_factory.mktemp("plain"), **{"training.steps": "4"})).losses


@pytest.mark.parametrize("overrides", [
    {"activation_checkpoint.mode": "full"},
    {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective": "ops"},
    {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective": "layers"},
    {"training.grad_accum_steps": "2"},
], ids=["ac-full", "ac-ops", "ac-layers", "accum2"])
def test_same_losses_as_without(plain, tmp_path, jobs, overrides):
    losses = train(jobs.tiny(tmp_path, **{"training.steps": "4", **overrides})).losses
    # Recomputation repeats the same fp32 ops: equal. Accumulation sums microbatch gradients in another order.
    rel = 1e-5 if "training.grad_accum_steps" in overrides else 0
    for step, loss in plain.items():
        assert losses[step] == pytest.approx(loss, rel=rel, abs=0)


def test_jsonl_data_with_a_hugging_face_tokenizer(tmp_path, jobs):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in texts))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    overrides = {"training.steps": "4", "data.source": str(tmp_path / "train.jsonl"), "data.text_field": "content",
                 "data.tokenizer": str(tmp_path / "tokenizer.json")}
    result = train(jobs.tiny(tmp_path / "run", **overrides))
    assert result.losses[4] < result.losses[1]
    with pytest.raises(ValueError, match="the tokenizer needs a vocabulary of"):
        train(jobs.tiny(tmp_path / "small", **overrides, **{"model.vocab_size": "128"}))


def test_plans_a_model_cannot_take_are_errors():
    import dataclasses

    import titan_models as tm
    from titan_train.model_setup import build_on_meta
    from titan_train.parallelize import check_tp_divisibility

    debug = tm.flavor("llama3", "debug")  # 4 heads, 2 kv heads
    model = build_on_meta(debug)
    check_tp_divisibility(model, 2, 64)
    with pytest.raises(ValueError, match="tp=4 does not divide the model's num_kv_heads=2"):
        check_tp_divisibility(model, 4, 64)
    with pytest.raises(ValueError, match="tp=2 does not divide training.seq_len=63"):
        check_tp_divisibility(model, 2, 63)
    with pytest.raises(ValueError, match="tied embeddings"):
        check_tp_divisibility(build_on_meta(dataclasses.replace(debug, tie_embeddings=True)), 2, 64)


@pytest.mark.parametrize("recipe", ["qwen3_5_debug", "qwen3_next_debug", "kimi_linear_debug"])
def test_linear_attention_debug_recipes_train_on_cpu(tmp_path, recipe):
    from titan_train import load_recipe
    from titan_train.cli_args import apply_override

    config = load_recipe(recipe)
    # 2 layers keep one Gated DeltaNet (Kimi: KDA) and one attention layer; 80 tokens pass the 64-token chunk.
    tiny = {"job.device": "cpu",
            "model.num_layers": "2", "training.seq_len": "80", "training.batch_size": "4", "training.steps": "6",
            "metrics.tensorboard": "false", "metrics.progress": "false", "lr_schedule.warmup_steps": "2",
            "checkpoint.resume": "false", "job.folder": str(tmp_path)}
    for name, value in tiny.items():
        apply_override(config, name, value)
    losses = train(config).losses
    assert all(loss == loss for loss in losses.values()) and losses[6] < losses[1]
    # op-level selective recomputation repeats the same fp32 ops (the chunked delta rule included)
    for name, value in {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective": "ops",
                        "job.folder": str(tmp_path / "ac")}.items():
        apply_override(config, name, value)
    assert train(config).losses == losses

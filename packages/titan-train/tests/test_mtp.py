"""Multi-token prediction (DeepSeek-V3 and DeepSeek-V4, one MTP module) in one process, against the objective written
out by hand from the model's own modules: main cross-entropy + lambda * MTP cross-entropy, each a mean
over its scored tokens, on packed documents (the MTP target of position i, token i + 2, only counts
when tokens i, i + 1 and i + 2 share a document).

The reference is titan-models' `forward_with_mtp` (full logits, torch's cross_entropy) on an independent
build of the same flavor with the same init seed; the trainer's step goes through its fused chunked
loss, its own MTP targets and weight. Tolerance: relative 1e-5 on the losses and on every parameter's
gradient (fp32, the same operations in another order: ~1e-7 seen). A control shows the comparison has
teeth: the main loss's gradient alone differs from the trainer's by far more than that.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import titan_models as tm
from titan_train import load_recipe
from titan_train.cli_args import apply_override
from titan_train.trainer import Trainer

LAMBDA = 0.3
JOB = {"job.device": "cpu", "model.num_layers": "2", "training.seq_len": "96", "training.batch_size": "4",
       "metrics.tensorboard": "false", "metrics.progress": "false", "checkpoint.resume": "false",
       "training.steps": "1", "parallelism.ep": "1", "model.mtp_layers": "1",
       "training.mtp_loss_weight": str(LAMBDA), "training.max_grad_norm": "0"}


def reference_model(vocab_size: int, family: str = "deepseek_v3") -> torch.nn.Module:
    config = tm.transforms.num_layers(2)(tm.flavor(family, "debug"))
    model = dataclasses.replace(config, vocab_size=vocab_size, mtp=True).build()
    model.init_weights(seed=0)
    return model


def hand_objective(model, tokens, labels, document_ids):
    """(main, mtp) mean losses from forward_with_mtp's full logits; targets by hand from the labels."""
    logits, mtp_logits = model.forward_with_mtp(tokens, context=tm.AttentionContext(document_ids=document_ids))
    main = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    # token i + 2 is labels[i + 1]; it is position i's when label i and label i + 1 are both in-document
    target = torch.where((labels[:, :-1] != -100) & (labels[:, 1:] != -100), labels[:, 1:], -100)
    mtp = F.cross_entropy(mtp_logits[:, :-1].flatten(0, 1), target.flatten(), ignore_index=-100)
    return main, mtp


def short_documents(folder) -> str:
    """A jsonl corpus of short documents, so that each sequence packs several (a document of 1 or 2 tokens
    included, which has no MTP target at all)."""
    import json

    path = folder / "docs.jsonl"
    texts = ["a", "to", *(f"def f{i}(x):\n    return x * {i} + {'y' * (i % 7)}" for i in range(40))]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


# DeepSeek-V4: its MTP module reads the main model's streams (before hc_head); a hash layer then a top-k one,
# titan-models' MoE, no selection-bias update (the step's update would move the reference's bias apart)
FAMILIES = {"deepseek_v3": ("deepseek_v3_debug_ep", {}, "mtp.eh_proj.weight"),
            "deepseek_v4": ("deepseek_v4_debug", {"model.moe_impl": "titan", "training.moe_bias_update_rate": "0"},
                            "mtp.h_proj.weight")}


@pytest.mark.filterwarnings(r"ignore:Seems like .optimizer.step\(\).:UserWarning")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mtp_step_matches_main_plus_lambda_mtp_by_hand(tmp_path, family):
    recipe, extra, mtp_weight_name = FAMILIES[family]
    config = load_recipe(recipe)
    for name, value in {**JOB, **extra, "job.folder": str(tmp_path / "run"), "data.source": short_documents(tmp_path),
                        "data.shuffle": "false"}.items():
        apply_override(config, name, value)
    trainer = Trainer(config, torch.device("cpu"))
    batch = config.data.build(trainer.tokenizer, vocab_size=trainer.model_cfg.vocab_size, seq_len=96,
                              seed=config.job.seed).next_batch(4)  # the batch the trainer's loader gives first
    assert (batch.labels == -100).any(), "the batch should pack several documents"
    grads = {}
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: (grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()}),
                                      step())
    model = reference_model(trainer.model_cfg.vocab_size, family)
    reference_state = model.state_dict()
    for name, value in trainer.model.state_dict().items():  # the same initial weights, independently built
        assert torch.equal(value, reference_state[name]), name

    loss, _, mtp_loss = trainer.train_step(1)
    main, mtp = hand_objective(model, batch.tokens, batch.labels, batch.document_ids)
    assert float(loss) == pytest.approx(float(main.detach()), rel=1e-5)
    assert float(mtp_loss) == pytest.approx(float(mtp.detach()), rel=1e-5)
    (main + LAMBDA * mtp).backward()
    assert any(n.startswith("mtp.") for n in grads) and float(grads[mtp_weight_name].abs().sum()) > 0
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)

    # Control: without the MTP term the shared weights' gradients are visibly different.
    model.zero_grad()
    hand_objective(model, batch.tokens, batch.labels, batch.document_ids)[0].backward()
    difference = (grads["tok_embeddings.weight"] - model.tok_embeddings.weight.grad).abs().max()
    assert difference > 1e-3 * grads["tok_embeddings.weight"].abs().max()


def test_mtp_settings_that_cannot_run_are_errors():
    from titan_train.model_setup import model_config

    config = load_recipe("llama3_debug")
    config.model.mtp_layers = 1
    with pytest.raises(ValueError, match="the llama3 family has no multi-token-prediction module"):
        model_config(config.model, vocab_needed=0)
    config = load_recipe("deepseek_v3_debug_ep")
    config.model.mtp_layers = 2
    with pytest.raises(ValueError, match="allowed: 0, 1"):
        model_config(config.model, vocab_needed=0)
    config.training.mtp_loss_weight = -0.1
    with pytest.raises(ValueError, match="training.mtp_loss_weight must be a finite number >= 0"):
        config.training.check()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_mtp_run_resumes_bitwise_and_exports_with_deepseek_names(tmp_path):
    """The MTP module is model state: checkpointed, resumed (the resumed curve, MTP loss included, is the
    uninterrupted one bit for bit), and written to a Hugging Face folder under DeepSeek's released names."""
    import json

    from safetensors import safe_open

    from titan_train import train

    def run(folder, **extra):
        config = load_recipe("deepseek_v3_debug_ep")
        for name, value in {**JOB, "job.folder": str(folder), "training.steps": "4", "training.seq_len": "32",
                            "training.max_grad_norm": "1", **extra}.items():
            apply_override(config, name, value)
        train(config)
        return {r["step"]: (r["loss"], r["mtp_loss"]) for r in
                map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())}

    whole = run(tmp_path / "whole", **{"checkpoint.interval": "4"})
    run(tmp_path / "resumed", **{"checkpoint.interval": "2", "training.steps": "2"})
    assert run(tmp_path / "resumed", **{"checkpoint.interval": "2", "checkpoint.resume": "true"}) == whole

    from torch_checkpointing import Checkpointer

    model = reference_model(384)
    state = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    with Checkpointer(str(tmp_path / "whole" / "checkpoints")) as checkpoints:
        checkpoints.load(state, step=4)
    assert not torch.equal(state["model"]["mtp.eh_proj.weight"], model.state_dict()["mtp.eh_proj.weight"])
    model.load_state_dict(state["model"])
    tm.hf.to_hf(model, tmp_path / "hf")
    names = set()
    for file in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    mtp = "model.layers.2."  # the MTP module is decoder layer num_hidden_layers
    assert {mtp + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                              "mlp.gate.weight", "embed_tokens.weight", "shared_head.head.weight")} <= names
    with safe_open(str(next((tmp_path / "hf").glob("*.safetensors"))), "pt") as f:
        if mtp + "eh_proj.weight" in f.keys():
            assert torch.equal(f.get_tensor(mtp + "eh_proj.weight"), state["model"]["mtp.eh_proj.weight"])

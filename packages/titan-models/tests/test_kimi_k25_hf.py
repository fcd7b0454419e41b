"""Kimi K2.x (`kimi_k25` composite image-text checkpoints): the DeepSeek-V3 text model and the vision tower
load through the kimi_k25 family, the head ties as transformers resolves it (images: test_kimi_k25_vision.py)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tm_reference import load_hf, rel_err, save_hf

import titan_models as tm
from titan_models.models.kimi_k25.hf import TINY_HF_CONFIGS

CASE = TINY_HF_CONFIGS["composite"]
SEQ = 80


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _saved(folder, **top_level):
    fields = dict(CASE.config) | top_level
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    return save_hf(config, folder, auto_class="AutoModelForImageTextToText")


def _tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _rewrite(folder, tensors: dict[str, torch.Tensor], **config_changes) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text()) | config_changes
    (folder / "config.json").write_text(json.dumps(config))


def test_release_layout_with_an_untied_head_matches_transformers(tmp_path):
    # The release names: language_model.model.layers.* and language_model.lm_head.weight (transformers 5.20
    # writes `blocks` for `layers`; it reads both).
    reference = _saved(tmp_path, tie_word_embeddings=False)
    tensors = {k.replace("language_model.model.blocks.", "language_model.model.layers."): v
               for k, v in _tensors(tmp_path).items()}
    assert "language_model.lm_head.weight" in tensors and any(".layers." in k for k in tensors)
    _rewrite(tmp_path, tensors)
    model = tm.from_hf(tmp_path)
    assert not model.config.tie_embeddings
    assert torch.equal(model.output.weight, tensors["language_model.lm_head.weight"])
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        assert rel_err(model(tokens), reference(tokens).logits) < 1e-5
        again = load_hf(tmp_path, auto_class="AutoModelForImageTextToText")  # transformers reads it the same
        assert rel_err(model(tokens), again(tokens).logits) < 1e-5


def test_the_composite_default_ties_the_head_and_loads_the_vision_tower(tmp_path):
    # text_config says tie_word_embeddings=False; Kimi_K25Config's default (True) decides.
    reference = _saved(tmp_path)
    assert reference.lm_head.weight.data_ptr() == reference.get_input_embeddings().weight.data_ptr()
    assert not any("lm_head" in k for k in _tensors(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no tensor is left unloaded
        model = tm.from_hf(tmp_path)
    assert model.config.tie_embeddings and model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.visual.pos_embed, _tensors(tmp_path)["vision_tower.patch_embed.pos_emb.weight"])


def test_a_stored_head_is_kept_under_the_tied_default_as_transformers_does(tmp_path):
    _saved(tmp_path)
    tensors = _tensors(tmp_path)
    tensors["language_model.lm_head.weight"] = torch.randn_like(tensors["language_model.model.embed_tokens.weight"])
    _rewrite(tmp_path, tensors)
    reference = load_hf(tmp_path, auto_class="AutoModelForImageTextToText")  # declines to tie (it warns)
    assert torch.equal(reference.lm_head.weight, tensors["language_model.lm_head.weight"])
    model = tm.from_hf(tmp_path)
    assert not model.config.tie_embeddings
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        assert rel_err(model(tokens), reference(tokens).logits) < 1e-5


def test_kimi_k26_flavor_writes_a_deepseek_v3_config_and_has_kimi_k2s_shape():
    import time

    config = tm.flavor("deepseek_v3", "kimi-k2.6")
    with torch.device("meta"):  # the first build in a process pays a one-off setup (~15 s on a busy CPU)
        tm.flavor("deepseek_v3", "debug").build()
    start = time.perf_counter()
    with torch.device("meta"):
        model = config.build()
    assert time.perf_counter() - start < 10 and model.layers["1"].moe.experts.w1.shape == (384, 2048, 7168)
    hf = tm.family("deepseek_v3").hf.config_to_hf(config)
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"] and hf["n_routed_experts"] == 384
    counts = tm.count_params(config)
    # the Kimi K2 report's 1.04T total and the card's 32B activated (ours leaves the embedding out, as DeepSeek)
    assert abs(counts.main - 1.04e12) / 1.04e12 < 0.015
    assert abs(counts.active - counts.embedding - 32e9) / 32e9 < 0.015


def test_a_kimi_config_without_text_config_is_refused_naming_the_field():
    converter = tm.family("kimi_k25").hf
    with pytest.raises(ValueError, match="text_config"):
        converter.config_from_hf({"architectures": ["Kimi_K25ForConditionalGeneration"], "model_type": "kimi_k25"},
                                 set())
    text = dict(CASE.config["text_config"]) | {"model_type": "llama"}
    with pytest.raises(ValueError, match="model_type"):
        converter.config_from_hf(dict(CASE.config) | {"text_config": text}, set())

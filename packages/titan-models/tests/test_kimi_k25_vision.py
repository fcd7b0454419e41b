"""Kimi K2.x with images against transformers' Kimi_K25ForConditionalGeneration (fp32, both ways): one and
several images of different sizes per sample (grids smaller and larger than the position table), text-only
calls bitwise equal to the DeepSeek-V3 text model, and the errors for mismatched image tokens."""
from __future__ import annotations

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tm_reference import build, load_hf, rel_err, save_hf

import titan_models as tm
from titan_models.models.kimi_k25.hf import TINY_CONFIG

IMAGE, START, END = 130, 126, 127
MERGE, PATCH = 2, 4
KIMI = tm.family("kimi_k25")


def _hf_config(**overrides):
    fields = dict(TINY_CONFIG) | overrides
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def _batch(images_per_sample: list[list[tuple[int, int]]], *, seq: int = 96, seed: int = 0):
    """tokens [b, seq] with each sample's images (grids in patches, h x w) between text runs, the
    patches of all images in order [patches, 3, patch, patch], and image_grid_thw."""
    gen = torch.Generator().manual_seed(seed)
    rows, grids = [], []
    for images in images_per_sample:
        row: list[int] = []
        for h, w in images:
            row += torch.randint(0, 126, (5,), generator=gen).tolist() + [START] + [IMAGE] * (h * w // MERGE**2) + [END]
            grids.append((1, h, w))
        assert len(row) < seq
        rows.append(row + torch.randint(0, 126, (seq - len(row),), generator=gen).tolist())
    grid_thw = torch.tensor(grids)
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3, PATCH, PATCH, generator=gen)
    return torch.tensor(rows), pixels, grid_thw


def _reference_logits(reference, tokens, pixels, grid_thw):
    return reference(input_ids=tokens, pixel_values=pixels, image_grid_thw=grid_thw).logits


CASES = {"one-image-each": [[(8, 12)], [(6, 6)]],  # 8 x 8 table: resampled up and down
         "several-sizes": [[(4, 4), (6, 10), (2, 14)], [(10, 4)]]}


@pytest.mark.parametrize("case", CASES)
def test_from_hf_with_images_matches_transformers(tmp_path, case):
    reference = save_hf(_hf_config(), tmp_path, auto_class="AutoModelForImageTextToText")
    model = tm.from_hf(tmp_path)
    assert type(model.config).__name__ == "KimiK25Config"
    tokens, pixels, grid_thw = _batch(CASES[case])
    with torch.no_grad():
        want = _reference_logits(reference, tokens, pixels, grid_thw)
        assert rel_err(model(tokens, pixel_values=pixels, image_grid_thw=grid_thw), want) < 1e-5
        # controls: the image features move the logits (placeholders embedded as token 0 instead)
        assert rel_err(model(tokens.masked_fill(tokens == IMAGE, 0)), want) > 1e-3
        model.visual.pos_embed.copy_(model.visual.pos_embed.flip(0))  # and the position table's orientation matters
        assert rel_err(model(tokens, pixel_values=pixels, image_grid_thw=grid_thw), want) > 1e-4


def test_both_names_of_the_projector_norm_are_read(tmp_path):
    # transformers writes model.mm_projector.pre_norm.*, the release (and to_hf) mm_projector.pre_norm.*
    save_hf(_hf_config(), tmp_path, auto_class="AutoModelForImageTextToText")
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert "model.mm_projector.pre_norm.weight" in tensors
    saved = tm.from_hf(tmp_path)
    renamed = {k.replace("model.mm_projector.", "mm_projector."): v for k, v in tensors.items()}
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    release = tm.from_hf(tmp_path)
    assert torch.equal(release.visual.projector.norm.weight, tensors["model.mm_projector.pre_norm.weight"])
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), release.state_dict().values()))


def _randomised(model):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):  # init zeroes biases, which would hide a swapped one
                param.normal_(0.0, 0.05)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_to_hf_with_images_loads_in_transformers_with_the_same_logits(tmp_path, tied):
    config = KIMI.hf.config_from_hf(dict(TINY_CONFIG) | {"tie_word_embeddings": tied}, set())
    model = _randomised(build(config, seed=3))
    tm.to_hf(model, tmp_path)
    reference = load_hf(tmp_path, auto_class="AutoModelForImageTextToText")
    assert type(reference).__name__ == "Kimi_K25ForConditionalGeneration"
    tokens, pixels, grid_thw = _batch(CASES["several-sizes"], seed=1)
    with torch.no_grad():
        got = model(tokens, pixel_values=pixels, image_grid_thw=grid_thw)
        assert rel_err(_reference_logits(reference, tokens, pixels, grid_thw), got) < 1e-5
        assert torch.equal(tm.from_hf(tmp_path)(tokens, pixel_values=pixels, image_grid_thw=grid_thw), got)


def test_text_only_calls_equal_the_text_model_bitwise():
    config = tm.flavor("kimi_k25", "debug")
    model = build(config, seed=2)
    text = build(config.text_config(), seed=2)
    text.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("visual.")})
    tokens = torch.randint(0, 2000, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), text(tokens))


def test_image_tokens_that_do_not_match_the_images_name_the_sample():
    config = tm.flavor("kimi_k25", "debug")
    image = config.image_token_id
    model = build(config)
    grid = torch.tensor([[1, 4, 4]])  # 4 merged tokens
    pixels = torch.randn(16, 3, 14, 14)
    with pytest.raises(ValueError, match="sample 1 has more image tokens than images"):
        model(torch.tensor([[1, image, image, image, image, 2], [1, image, 2, 3, 4, 5]]), pixel_values=pixels,
              image_grid_thw=grid)
    with pytest.raises(ValueError, match="sample 0 holds 2 image tokens, which do not end at an image boundary"):
        model(torch.tensor([[1, image, image, 2, 3, 4]]), pixel_values=pixels, image_grid_thw=grid)
    with pytest.raises(ValueError, match="lists 2 images but the samples' image tokens hold 1"):
        model(torch.tensor([[1, image, image, image, image, 2]]), pixel_values=torch.randn(20, 3, 14, 14),
              image_grid_thw=torch.tensor([[1, 4, 4], [1, 2, 2]]))
    with pytest.raises(ValueError, match="pixel_values has shape"):
        model(torch.tensor([[1, image, image, image, image, 2]]), pixel_values=torch.randn(15, 3, 14, 14),
              image_grid_thw=grid)


def test_a_backward_with_images_reaches_every_parameter():
    config = KIMI.hf.config_from_hf(dict(TINY_CONFIG), set())
    model = build(config)
    tokens, pixels, grid_thw = _batch(CASES["several-sizes"])
    model(tokens, pixel_values=pixels, image_grid_thw=grid_thw).logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing, missing

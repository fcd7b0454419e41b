"""Muse Glimmer's vision tower (with adapter, projection and norm) against transformers'
MuseGlimmerModel.get_image_features in fp32: windowed and full-attention blocks, several images of
different sizes (larger and smaller than the window and the position table); and the whole model with
images against MuseGlimmerForConditionalGeneration, both ways."""
from __future__ import annotations

import pytest
import torch
import transformers
from tm_reference import build, load_hf, rel_err, save_hf

import titan_models as tm

from titan_models.models.muse_glimmer.hf import TINY_TEXT, vision_hf_name
from titan_models.models.muse_glimmer.vision import MuseVisionConfig

VISION = {"patch_size": 2, "pos_emb_height": 4, "pos_emb_width": 4, "num_attention_heads": 2,
          "num_hidden_layers": 5, "hidden_size": 32, "intermediate_size": 64, "merge_size": 2}
GRIDS = {"one": [(6, 10)], "several-sizes": [(4, 4), (10, 6), (2, 8), (8, 12)]}


def _reference():
    config = transformers.AutoConfig.for_model(
        "muse_glimmer", text_config=TINY_TEXT, vision_config=VISION, out_hidden_size=128, projector_hidden_size=48,
        image_token_id=0, video_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager",
                                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name or "ln_" in name else param.normal_(0.0, 0.2)
    return model


def _tower(reference):
    config = MuseVisionConfig(depth=5, dim=32, ffn_dim=64, num_heads=2, adapter_dim=48, out_dim=64, patch_size=2,
                              pos_emb_size=4, merge_size=2, text_norm_eps=reference.config.text_config.rms_norm_eps)
    tower = config.build()
    state = reference.state_dict()
    tower.load_state_dict({name: state[vision_hf_name(name)] for name in tower.state_dict()})
    return tower.eval()


@pytest.mark.parametrize("case", GRIDS)
def test_tower_matches_transformers_image_features(case):
    reference = _reference()
    tower = _tower(reference)
    assert tower.config.resolved_full_attention_layers() == (3, 4)
    grid = torch.tensor([(1, h, w) for h, w in GRIDS[case]])
    pixels = torch.randn(int(grid.prod(-1).sum()), tower.config.patch_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = torch.cat(reference.model.get_image_features(pixels, grid).pooler_output)
        got = tower(pixels, grid)
        assert got.shape == want.shape and rel_err(got, want) < 1e-5
        # control: attention over whole images in every block (no windows) is far off
        full = MuseVisionConfig(**{**tower.config.__dict__, "full_attention_layers": tuple(range(5))}).build()
        full.load_state_dict(tower.state_dict())
        if any(h > 4 or w > 4 for h, w in GRIDS[case]):
            assert rel_err(full(pixels, grid), want) > 1e-4


IMAGE, MERGE = 120, 2
COMPOSITE = {"model_type": "muse_glimmer", "architectures": ["MuseGlimmerForConditionalGeneration"],
             "text_config": TINY_TEXT, "vision_config": VISION, "out_hidden_size": 128, "projector_hidden_size": 48,
             "image_token_id": IMAGE, "video_token_id": 121}
SAMPLES = {"one-image-each": [[(6, 10)], [(4, 4)]], "several-sizes": [[(4, 4), (10, 6), (2, 8)], [(8, 6)]]}


def _batch(images_per_sample, *, seq: int = 96, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows, grids = [], []
    for images in images_per_sample:
        row: list[int] = []
        for h, w in images:
            row += torch.randint(1, 110, (5,), generator=gen).tolist() + [IMAGE] * (h * w // MERGE**2)
            grids.append((1, h, w))
        rows.append(row + torch.randint(1, 110, (seq - len(row),), generator=gen).tolist())
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(-1).sum()), 2 * 3 * 2 * 2, generator=gen)
    return torch.tensor(rows), pixels, grid


@pytest.mark.parametrize("case", SAMPLES)
def test_from_hf_with_images_matches_transformers(tmp_path, case):
    fields = dict(COMPOSITE)
    reference = save_hf(transformers.AutoConfig.for_model(fields.pop("model_type"), **fields), tmp_path,
                        auto_class="AutoModelForImageTextToText")
    model = tm.from_hf(tmp_path)
    assert model.config.vision is not None
    tokens, pixels, grid = _batch(SAMPLES[case])
    with torch.no_grad():
        want = reference(input_ids=tokens, pixel_values=pixels, image_grid_thw=grid).logits
        assert rel_err(model(tokens, pixel_values=pixels, image_grid_thw=grid), want) < 1e-5
        assert rel_err(model(tokens.masked_fill(tokens == IMAGE, 0)), want) > 1e-3  # control: images matter


def test_to_hf_with_images_loads_in_transformers_with_the_same_logits(tmp_path):
    config = tm.family("muse_glimmer").hf.config_from_hf(dict(COMPOSITE), set())
    model = build(config, seed=3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.05)
    tm.to_hf(model, tmp_path)
    reference = load_hf(tmp_path, auto_class="AutoModelForImageTextToText")
    tokens, pixels, grid = _batch(SAMPLES["several-sizes"], seed=1)
    with torch.no_grad():
        got = model(tokens, pixel_values=pixels, image_grid_thw=grid)
        assert rel_err(reference(input_ids=tokens, pixel_values=pixels, image_grid_thw=grid).logits, got) < 1e-5
        assert torch.equal(tm.from_hf(tmp_path)(tokens, pixel_values=pixels, image_grid_thw=grid), got)


def test_image_tokens_that_do_not_match_the_images_name_the_sample():
    model = build(tm.family("muse_glimmer").hf.config_from_hf(dict(COMPOSITE), set()))
    tokens, pixels, grid = _batch(SAMPLES["one-image-each"])
    tokens[1, -1] = IMAGE
    with pytest.raises(ValueError, match="sample 1 has more image tokens than images"):
        model(tokens, pixel_values=pixels, image_grid_thw=grid)


def test_text_only_calls_equal_the_text_model_bitwise():
    model = build(tm.flavor("muse_glimmer", "debug_vision"), seed=2)
    text = build(tm.flavor("muse_glimmer", "debug"), seed=2)
    text.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("visual.")})
    tokens = torch.randint(0, 2000, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), text(tokens))

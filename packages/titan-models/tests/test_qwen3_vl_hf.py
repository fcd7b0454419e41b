"""Qwen3-VL with images against transformers' Qwen3VLForConditionalGeneration (fp32, both ways): one and
several images of different sizes per sample, 3-D positions against transformers' get_rope_index, text-only
calls bitwise equal to the Qwen3 text model, and the errors for mismatched image tokens."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from tm_reference import build, load_hf, rel_err, save_hf

import titan_models as tm
from titan_models.models.qwen3.model import Qwen3Config
from titan_models.models.qwen3_vl.hf import TINY_CONFIG, TINY_MOE_CONFIG
from titan_models.models.qwen3_vl.positions import mrope_positions

IMAGE, START, END = 150, 152, 153
MERGE, PATCH_DIM = 2, 3 * 2 * 4 * 4


def _hf_config(base=TINY_CONFIG, **overrides):
    fields = dict(base) | overrides
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def _batch(images_per_sample: list[list[tuple[int, int]]], *, seq: int = 96, seed: int = 0):
    """tokens [b, seq] with each sample's images (grids in patches, h x w) between text runs, the
    patches of all images in order, and image_grid_thw."""
    gen = torch.Generator().manual_seed(seed)
    rows, grids = [], []
    for images in images_per_sample:
        row: list[int] = []
        for h, w in images:
            row += torch.randint(0, 140, (5,), generator=gen).tolist() + [START] + [IMAGE] * (h * w // MERGE**2) + [END]
            grids.append((1, h, w))
        assert len(row) < seq
        rows.append(row + torch.randint(0, 140, (seq - len(row),), generator=gen).tolist())
    grid_thw = torch.tensor(grids)
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), PATCH_DIM, generator=gen)
    return torch.tensor(rows), pixels, grid_thw


def _reference_logits(reference, tokens, pixels, grid_thw):
    return reference(input_ids=tokens, pixel_values=pixels, image_grid_thw=grid_thw,
                     mm_token_type_ids=(tokens == IMAGE).int()).logits


CASES = {"one-image-each": [[(8, 12)], [(6, 6)]],
         "several-sizes": [[(4, 4), (6, 8), (2, 10)], [(10, 4)]]}
CONFIGS = {"dense": TINY_CONFIG, "moe": TINY_MOE_CONFIG}


@pytest.mark.parametrize(("config", "case"), [("dense", c) for c in CASES] + [("moe", "several-sizes")])
def test_from_hf_with_images_matches_transformers(tmp_path, config, case):
    reference = save_hf(_hf_config(CONFIGS[config]), tmp_path, auto_class="AutoModelForImageTextToText")
    model = tm.from_hf(tmp_path)
    tokens, pixels, grid_thw = _batch(CASES[case])
    with torch.no_grad():
        want = _reference_logits(reference, tokens, pixels, grid_thw)
        assert rel_err(model(tokens, pixel_values=pixels, image_grid_thw=grid_thw), want) < 1e-5
        # controls: images do move the logits, and the DeepStack features matter
        assert rel_err(model(tokens), want) > 1e-3
        model.visual.deepstack_mergers[1].w2.bias.add_(0.5)
        assert rel_err(model(tokens, pixel_values=pixels, image_grid_thw=grid_thw), want) > 1e-3


@pytest.mark.parametrize("kind", CONFIGS)
def test_to_hf_with_images_loads_in_transformers_with_the_same_logits(tmp_path, kind):
    config = tm.qwen3_vl.FAMILY.hf.config_from_hf(dict(CONFIGS[kind]), set())
    model = build(config, seed=3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):  # init zeroes biases, which would hide a swapped one
                param.normal_(0.0, 0.05)
    tm.to_hf(model, tmp_path)
    reference = load_hf(tmp_path, auto_class="AutoModelForImageTextToText")
    assert type(reference).__name__ == CONFIGS[kind]["architectures"][0]
    tokens, pixels, grid_thw = _batch(CASES["several-sizes"], seed=1)
    with torch.no_grad():
        got = model(tokens, pixel_values=pixels, image_grid_thw=grid_thw)
        assert rel_err(_reference_logits(reference, tokens, pixels, grid_thw), got) < 1e-5
        assert torch.equal(tm.from_hf(tmp_path)(tokens, pixel_values=pixels, image_grid_thw=grid_thw), got)


def test_positions_match_transformers_rope_index(tmp_path):
    reference = save_hf(_hf_config(), tmp_path, auto_class="AutoModelForImageTextToText")
    tokens, _, grid_thw = _batch([[(4, 4), (6, 8), (2, 10)], [(10, 4)], [(8, 2)]])
    want, deltas = reference.model.get_rope_index(tokens, image_grid_thw=grid_thw,
                                                  mm_token_type_ids=(tokens == IMAGE).int())
    got, next_position = mrope_positions(tokens, grid_thw, image_token_id=IMAGE, spatial_merge_size=MERGE)
    assert torch.equal(got, want)
    assert torch.equal(next_position, deltas[:, 0] + tokens.shape[1])


def test_text_only_calls_equal_the_text_model_bitwise():
    config = tm.flavor("qwen3_vl", "debug")
    model = build(config, seed=2)
    text = build(Qwen3Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(Qwen3Config)}), seed=2)
    text.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("visual.")})
    tokens = torch.randint(0, 2000, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), text(tokens))


def test_image_tokens_that_do_not_match_the_images_name_the_sample():
    config = tm.flavor("qwen3_vl", "debug")
    image = config.image_token_id
    grid = torch.tensor([[1, 4, 4]])  # 4 merged tokens
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [1, image, image, image, image, image, image, 2]])
    with pytest.raises(ValueError, match="sample 1 has more image tokens than images"):
        mrope_positions(tokens, grid, image_token_id=image, spatial_merge_size=2)
    tokens = torch.tensor([[1, image, image, 2, image, image, 3, 4]])
    with pytest.raises(ValueError, match="sample 0: image 0 needs 4 image tokens"):
        mrope_positions(tokens, grid, image_token_id=image, spatial_merge_size=2)
    with pytest.raises(ValueError, match="lists 2 images but the samples' image tokens hold 1"):
        mrope_positions(torch.tensor([[1, image, image, image, image, 2]]), torch.tensor([[1, 4, 4], [1, 2, 2]]),
                        image_token_id=image, spatial_merge_size=2)
    model = build(config)
    with pytest.raises(ValueError, match="sample 1 has more image tokens"):
        model(torch.tensor([[1, 2, 3, 4, 5, 6], [1, image, image, image, image, image]]),
              pixel_values=torch.randn(16, config.vision.patch_dim), image_grid_thw=grid)


def test_a_backward_with_images_reaches_every_parameter():
    config = tm.qwen3_vl.FAMILY.hf.config_from_hf(dict(TINY_CONFIG), set())
    model = build(config)
    tokens, pixels, grid_thw = _batch(CASES["several-sizes"])
    model(tokens, pixel_values=pixels, image_grid_thw=grid_thw).logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing, missing


VIDEO = 151  # TINY_CONFIG's video_token_id


def _video_batch(*, with_images: bool, seq: int = 96, seed: int = 0):
    """Sample 0: [an image,] a 2-frame video, text; sample 1: a 3-frame video. Each frame's tokens between
    vision start/end after a few 'timestamp' tokens, as transformers' processor lays a video out."""
    gen = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, 140, (n,), generator=gen).tolist()  # noqa: E731
    videos = [(2, 4, 6), (3, 4, 4)]
    rows = []
    for sample, (t, h, w) in enumerate(videos):
        row = text(4)
        if with_images and sample == 0:
            row += [START] + [IMAGE] * 4 + [END] + text(2)
        for _ in range(t):
            row += text(3) + [START] + [VIDEO] * (h * w // MERGE**2) + [END]
        rows.append(row + text(seq - len(row)))
    video_grid = torch.tensor(videos)
    image_grid = torch.tensor([[1, 4, 4]]) if with_images else None
    videos_px = torch.randn(int(video_grid.prod(-1).sum()), PATCH_DIM, generator=gen)
    images_px = torch.randn(16, PATCH_DIM, generator=gen) if with_images else None
    return torch.tensor(rows), dict(pixel_values=images_px, image_grid_thw=image_grid,
                                    pixel_values_videos=videos_px, video_grid_thw=video_grid)


def _reference_video_logits(reference, tokens, inputs):
    kinds = (tokens == IMAGE).int() + 2 * (tokens == VIDEO).int()
    given = {k: v for k, v in inputs.items() if v is not None}
    return reference(input_ids=tokens, mm_token_type_ids=kinds, **given).logits


@pytest.mark.parametrize("with_images", [False, True], ids=["videos", "videos-and-an-image"])
def test_videos_match_transformers_both_ways(tmp_path, with_images):
    reference = save_hf(_hf_config(), tmp_path / "hf", auto_class="AutoModelForImageTextToText")
    model = tm.from_hf(tmp_path / "hf")
    tokens, inputs = _video_batch(with_images=with_images)
    with torch.no_grad():
        want = _reference_video_logits(reference, tokens, inputs)
        got = model(tokens, **inputs)
        assert rel_err(got, want) < 1e-5
        tm.to_hf(model, tmp_path / "back")
        again = load_hf(tmp_path / "back", auto_class="AutoModelForImageTextToText")
        assert rel_err(_reference_video_logits(again, tokens, inputs), got) < 1e-5
        # controls: the frames must attend each within itself, and the video's DeepStack features count
        frames_as_one = torch.tensor([[1, 8, 6], [1, 12, 4]])  # the same patches, as one tall frame each
        assert rel_err(model.visual(inputs["pixel_values_videos"], frames_as_one)[0],
                       model.visual(inputs["pixel_values_videos"], inputs["video_grid_thw"])[0]) > 1e-3
        model.visual.deepstack_mergers[0].w2.bias.add_(0.5)
        assert rel_err(model(tokens, **inputs), want) > 1e-3


def test_video_positions_match_transformers_rope_index(tmp_path):
    reference = save_hf(_hf_config(), tmp_path, auto_class="AutoModelForImageTextToText")
    tokens, inputs = _video_batch(with_images=True)
    kinds = (tokens == IMAGE).int() + 2 * (tokens == VIDEO).int()
    want, deltas = reference.model.get_rope_index(tokens, image_grid_thw=inputs["image_grid_thw"],
                                                  video_grid_thw=inputs["video_grid_thw"].clone(),
                                                  mm_token_type_ids=kinds)
    got, next_position = mrope_positions(tokens, inputs["image_grid_thw"], image_token_id=IMAGE,
                                         spatial_merge_size=MERGE, video_grid_thw=inputs["video_grid_thw"],
                                         video_token_id=VIDEO)
    assert torch.equal(got, want)
    assert torch.equal(next_position, deltas[:, 0] + tokens.shape[1])
    video_only, _ = _video_batch(with_images=False)
    with pytest.raises(ValueError, match="video_grid_thw lists 6 video frames but the samples' video frame tokens "
                                         "hold 5"):  # a third video the tokens never reach
        mrope_positions(video_only, None, image_token_id=IMAGE, spatial_merge_size=MERGE,
                        video_grid_thw=torch.tensor([[2, 4, 6], [3, 4, 4], [1, 4, 4]]), video_token_id=VIDEO)

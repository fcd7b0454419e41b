"""Qwen3-VL image preprocessing against transformers' image processor (value for value), and the errors
for missing and unreadable image files."""
from __future__ import annotations

import pytest
import torch
import transformers
from PIL import Image

from titan_models.models.qwen3_vl.preprocess import ImagePreprocessing, load_image

# Qwen3-VL's published preprocessor_config.json, with small pixel bounds so the test images get resized
# both up and down
SETTINGS = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                image_std=[0.5, 0.5, 0.5])


def _images() -> list[Image.Image]:
    gen = torch.Generator().manual_seed(0)
    def noise(w, h, mode="RGB"):
        channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        data = torch.randint(0, 256, (h, w, channels), generator=gen, dtype=torch.uint8)
        return Image.frombytes(mode, (w, h), data.numpy().tobytes())
    return [noise(97, 61), noise(40, 300), noise(320, 240), noise(33, 35, "RGBA"), noise(120, 64, "L")]


@pytest.mark.parametrize(("min_pixels", "max_pixels"), [(64 * 64, 256 * 256), (65536, 16777216)])
def test_preprocessing_equals_transformers_image_processor(min_pixels, max_pixels):
    reference = transformers.Qwen2VLImageProcessorPil(**SETTINGS, size={"shortest_edge": min_pixels,
                                                                        "longest_edge": max_pixels})
    images = _images()
    want = reference(images, return_tensors="pt")
    pixels, grid = ImagePreprocessing(min_pixels=min_pixels, max_pixels=max_pixels)(images)
    assert torch.equal(grid, want["image_grid_thw"])
    assert pixels.dtype == want["pixel_values"].dtype and torch.equal(pixels, want["pixel_values"])
    # control: a one-pixel shift of one image changes the output
    shifted = images[:2] + [images[2].transform(images[2].size, Image.Transform.AFFINE, (1, 0, 1, 0, 1, 0))] + images[3:]
    assert not torch.equal(ImagePreprocessing(min_pixels=min_pixels, max_pixels=max_pixels)(shifted)[0], pixels)


def test_auto_image_processor_for_qwen3_vl_is_the_reference():
    # the processor the model type maps to (the torchvision one when torchvision is installed, else this)
    assert transformers.models.auto.image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES["qwen3_vl"]["pil"] == \
        "Qwen2VLImageProcessorPil"


def test_missing_and_unreadable_images_name_the_sample(tmp_path):
    with pytest.raises(ValueError, match=r"line 3 of data.jsonl: image file .*nope.png' does not exist"):
        load_image(tmp_path / "nope.png", sample="line 3 of data.jsonl")
    (tmp_path / "bad.png").write_bytes(b"not an image at all")
    with pytest.raises(ValueError, match=r"line 4 of data.jsonl: image file .*bad.png' cannot be read"):
        load_image(tmp_path / "bad.png", sample="line 4 of data.jsonl")
    Image.new("RGB", (20, 10), (255, 0, 0)).save(tmp_path / "ok.png")
    assert load_image(tmp_path / "ok.png", sample="x").size == (20, 10)

"""Kimi K2.x and Muse Glimmer image preprocessing against transformers' image processors (value for value;
transformers has only torchvision-backed ones for these families, torchvision being a test dependency)."""
from __future__ import annotations

import pytest
import torch
import transformers
from PIL import Image

import titan_models.models.image_pixels as image_pixels
from titan_models.models.kimi_k25.preprocess import KimiImagePreprocessing
from titan_models.models.muse_glimmer.preprocess import MuseImagePreprocessing

pytest.importorskip("torchvision", reason="transformers' Kimi and Muse image processors need torchvision")


def _images() -> list[Image.Image]:
    gen = torch.Generator().manual_seed(0)

    def noise(w, h, mode="RGB"):
        channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        data = torch.randint(0, 256, (h, w, channels), generator=gen, dtype=torch.uint8)
        return Image.frombytes(mode, (w, h), data.numpy().tobytes())
    # sizes that need padding, none, up- and downscaling; a tall one; RGBA and greyscale converted to RGB
    return [noise(97, 61), noise(40, 300), noise(320, 240), noise(33, 35, "RGBA"), noise(120, 64, "L"),
            noise(13, 9), noise(28, 56)]


def _shifted(images: list[Image.Image]) -> list[Image.Image]:
    """The same images with the third moved by one pixel: a control the comparison must notice."""
    moved = images[2].transform(images[2].size, Image.Transform.AFFINE, (1, 0, 1, 0, 1, 0))
    return images[:2] + [moved] + images[3:]


def _assert_same(ours, want):
    pixels, grid = ours
    assert torch.equal(grid, want["image_grid_thw"])
    assert pixels.dtype == want["pixel_values"].dtype and pixels.shape == want["pixel_values"].shape
    assert torch.equal(pixels, want["pixel_values"])


@pytest.mark.parametrize("limits", [{}, {"max_patches": 64}, {"max_side_patches": 8}])
def test_kimi_preprocessing_equals_transformers_image_processor(limits):
    reference_kwargs = dict(limits)
    if "max_side_patches" in reference_kwargs:  # the processor's size dict holds the per-side cap
        side = reference_kwargs.pop("max_side_patches")
        reference_kwargs["size"] = {"max_height": side, "max_width": side}
    images = _images()
    want = transformers.Kimi_K25ImageProcessor(**reference_kwargs)(images, return_tensors="pt")
    ours = KimiImagePreprocessing(**limits)
    _assert_same(ours(images), want)
    assert not torch.equal(ours(_shifted(images))[0], want["pixel_values"])


@pytest.mark.parametrize("limits", [{}, {"max_image_tokens": 16}])
def test_muse_preprocessing_equals_transformers_image_processor(limits):
    images = _images()
    want = transformers.MuseGlimmerImageProcessor(**limits)(images, return_tensors="pt")
    ours = MuseImagePreprocessing(**limits)
    _assert_same(ours(images), want)
    assert not torch.equal(ours(_shifted(images))[0], want["pixel_values"])


def test_auto_image_processors_are_the_references():
    names = transformers.models.auto.image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES
    assert names["kimi_k25"] == {"torchvision": "Kimi_K25ImageProcessor"}
    assert names["muse_glimmer"] == {"torchvision": "MuseGlimmerImageProcessor"}


def test_from_pixels_equals_the_call_on_the_same_image():
    pixels = torch.randint(0, 256, (64, 64, 3), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    image = Image.fromarray(pixels.numpy())
    for pre in (KimiImagePreprocessing(), MuseImagePreprocessing()):
        got, want = pre.from_pixels(pixels), pre([image])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match=r"uint8 \[h, w, 3\]"):
        KimiImagePreprocessing().from_pixels(pixels.float())


def test_lanczos_without_torch_support_falls_back_to_bicubic_as_transformers_does(monkeypatch):
    # torch before 2.12 has no Lanczos interpolate, and transformers resizes bicubic below torchvision 0.27 (the
    # release paired with torch 2.12): both fallbacks forced, so this compares them on any torch
    images = _images()
    native, has_lanczos = MuseImagePreprocessing()(images)[0], image_pixels._torch_has_lanczos()
    monkeypatch.setattr(image_pixels, "_torch_has_lanczos", lambda: False)
    monkeypatch.setattr(transformers.image_processing_backends, "is_torchvision_greater_or_equal", lambda _: False)
    want = transformers.MuseGlimmerImageProcessor()(images, return_tensors="pt")
    with pytest.warns(UserWarning, match="no Lanczos interpolate"):
        image_pixels._warn_lanczos_falls_back.cache_clear()
        _assert_same(MuseImagePreprocessing()(images), want)
    if has_lanczos:  # a control: the fallback is not the Lanczos resize
        assert not torch.equal(native, want["pixel_values"])

"""Images -> what the Kimi K2.x model takes (`pixel_values`, `image_grid_thw`), without transformers.

Each image is converted to RGB and scaled down (never up), aspect ratio kept, until it has at most
`max_patches` patches and at most `max_side_patches` patches a side (sizes truncated to whole pixels);
resized bicubically with antialiasing; zero-padded at the bottom and right to multiples of patch * merge;
normalised ((x / 255 - mean) / std, fused in float32); and cut into patches in raster order, one
[3, patch, patch] entry each. This is what transformers' Kimi K2.5 image processor produces, value for value.

Pillow decodes (`pip install titan-models[images]`); resizing and the rest are torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titan_models.models.image_pixels import (check_rgb_uint8, normalize, pad_bottom_right, preprocess_each,
                                              raster_patches, resize_uint8)

if TYPE_CHECKING:
    from PIL import Image

    from titan_models.models.kimi_k25.vision import KimiVisionConfig


@dataclass(kw_only=True, frozen=True)
class KimiImagePreprocessing:
    """transformers' Kimi_K25ImageProcessor defaults (size {max_height, max_width: 512} is `max_side_patches`)."""

    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384
    max_side_patches: int = 512
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @staticmethod
    def for_vision(vision: KimiVisionConfig, **overrides) -> "KimiImagePreprocessing":
        """Settings whose patches fit `vision` (its patch and merge sizes)."""
        return KimiImagePreprocessing(patch_size=vision.patch_size, merge_size=vision.merge_size, **overrides)

    def target_size(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((height, width) after resizing, (height, width) after padding to multiples of patch * merge)."""
        p, side = self.patch_size, self.max_side_patches
        patches = max(1, height // p) * max(1, width // p)
        scale = min(1.0, math.sqrt(self.max_patches / patches), side * p / height, side * p / width)
        h = min(max(1, int(height * scale)), side * p)
        w = min(max(1, int(width * scale)), side * p)
        factor = p * self.merge_size
        return (h, w), (-(-h // factor) * factor, -(-w // factor) * factor)

    def __call__(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [patches, 3, patch, patch] float32, image_grid_thw [images, 3] int64)."""
        return preprocess_each(self.from_pixels, images)

    def from_pixels(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An RGB image as uint8 [h, w, 3] (no Pillow needed) -> (pixel_values, image_grid_thw [1, 3])."""
        check_rgb_uint8(pixels)
        (h, w), (padded_h, padded_w) = self.target_size(pixels.shape[0], pixels.shape[1])
        chw = resize_uint8(pixels.permute(2, 0, 1).contiguous(), h, w, "bicubic")
        x = normalize(pad_bottom_right(chw, padded_h, padded_w), self.mean, self.std)
        p = self.patch_size
        return raster_patches(x, p), torch.tensor([[1, padded_h // p, padded_w // p]])

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """No images: (pixel_values [0, 3, patch, patch], image_grid_thw [0, 3])."""
        return torch.zeros(0, 3, self.patch_size, self.patch_size), torch.zeros(0, 3, dtype=torch.long)

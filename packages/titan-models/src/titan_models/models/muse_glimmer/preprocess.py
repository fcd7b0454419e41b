"""Images -> what the Muse Glimmer model takes (`pixel_values`, `image_grid_thw`), without transformers.

Each image is converted to RGB and resized (Lanczos, antialiased) to the grid of merged patches
(patch * merge pixels each) nearest its aspect ratio among the floor/ceil grids of its own size, scaled
down first to at most `max_image_tokens` merged patches; normalised ((x / 255 - mean) / std, fused in
float32); and cut into patches in raster order, each row a still image repeated over the temporal patch
(temporal-major, then channel, row, column). This is what transformers' Muse Glimmer image processor
produces, value for value: on torch >= 2.12 with the Lanczos interpolate torchvision calls, before that
with bicubic, which transformers also falls back to below torchvision 0.27 (the release paired with torch 2.12).

Pillow decodes (`pip install titan-models[images]`); resizing and the rest are torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titan_models.models.image_pixels import check_rgb_uint8, normalize, preprocess_each, raster_patches, resize_uint8

if TYPE_CHECKING:
    from PIL import Image

    from titan_models.models.muse_glimmer.vision import MuseVisionConfig


@dataclass(kw_only=True, frozen=True)
class MuseImagePreprocessing:
    """transformers' MuseGlimmerImageProcessor defaults."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    max_image_tokens: int = 4096
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @staticmethod
    def for_vision(vision: MuseVisionConfig, **overrides) -> "MuseImagePreprocessing":
        """Settings whose patches fit `vision` (its patch, temporal patch and merge sizes)."""
        return MuseImagePreprocessing(patch_size=vision.patch_size, temporal_patch_size=vision.patch_temporal,
                                      merge_size=vision.merge_size, **overrides)

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after resizing: whole merged patches, aspect ratio as near as the grid allows."""
        cell, cap = self.patch_size * self.merge_size, self.max_image_tokens
        rows, cols = height / cell, width / cell
        if rows * cols > cap:  # shrink to the cap, the ratio kept
            ratio = cols / rows
            rows = (cap / ratio) ** 0.5
            cols = rows * ratio
        # set order breaks ties between grids of equal ratio error, as the reference's does
        grids = {(r, c) for r in (math.floor(rows), math.ceil(rows)) for c in (math.floor(cols), math.ceil(cols))}
        fitting = [(r, c) for r, c in grids if r >= 1 and c >= 1 and r * c <= cap]
        if not fitting:
            fitting = [(max(1, round(rows)), max(1, round(cols)))]
        r, c = min(fitting, key=lambda grid: abs(grid[0] / grid[1] - height / width))
        return r * cell, c * cell

    def __call__(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [patches, temporal_patch * 3 * patch^2] float32, image_grid_thw [images, 3] int64)."""
        return preprocess_each(self.from_pixels, images)

    def from_pixels(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An RGB image as uint8 [h, w, 3] -> (pixel_values, image_grid_thw [1, 3])."""
        check_rgb_uint8(pixels)
        h, w = self.target_size(pixels.shape[0], pixels.shape[1])
        x = normalize(resize_uint8(pixels.permute(2, 0, 1).contiguous(), h, w, "lanczos"), self.mean, self.std)
        p, t = self.patch_size, self.temporal_patch_size
        grid_h, grid_w = h // p, w // p
        patches = raster_patches(x, p).reshape(grid_h * grid_w, 1, 3 * p * p)  # a still image over t frames
        return patches.expand(-1, t, -1).reshape(grid_h * grid_w, t * 3 * p * p), torch.tensor([[1, grid_h, grid_w]])

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """No images: (pixel_values [0, temporal_patch * 3 * patch^2], image_grid_thw [0, 3])."""
        return torch.zeros(0, self.temporal_patch_size * 3 * self.patch_size**2), torch.zeros(0, 3, dtype=torch.long)

"""Images -> what the Qwen3-VL model takes (`pixel_values`, `image_grid_thw`), without transformers.

Each image is converted to RGB, resized (bicubic, Pillow) to the nearest size whose sides are multiples
of patch * merge with its pixel count within [min_pixels, max_pixels], scaled to [0, 1], normalised by
mean/std per channel, and cut into patches: one row per patch of channels x temporal_patch x patch x patch
values (a still image repeats over the temporal patch), the patches of each merge x merge block
consecutive. This is what transformers' Qwen3-VL image processor produces, value for value.

Pillow decodes and resizes: install titan-models with the `images` extra (`pip install titan-models[images]`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from PIL import Image

    from titan_models.models.qwen3_vl.vision import VisionConfig


@dataclass(kw_only=True, frozen=True)
class ImagePreprocessing:
    """The published Qwen3-VL preprocessor settings by default (preprocessor_config.json)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536  # "shortest_edge" in preprocessor_config.json
    max_pixels: int = 16777216  # "longest_edge"
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @staticmethod
    def for_vision(vision: VisionConfig, **overrides) -> "ImagePreprocessing":
        """Settings whose patches fit `vision` (its patch, temporal patch and merge sizes)."""
        return ImagePreprocessing(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                  merge_size=vision.spatial_merge_size, **overrides)

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after resizing: multiples of patch * merge, aspect ratio kept as near as may be."""
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"an image of {width}x{height} pixels has an aspect ratio over 200, which Qwen3-VL refuses")
        factor = self.patch_size * self.merge_size
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    def __call__(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [patches, 3 * temporal_patch * patch^2] float32, image_grid_thw [images, 3] int64)."""
        from PIL import Image

        patches, grids = [], []
        for image in images:
            image = image.convert("RGB")
            h, w = self.target_size(image.height, image.width)
            image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
            pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(h, w, 3)
            image_patches, grid = self.from_pixels(pixels)  # rescaled in float64, as the reference
            patches.append(image_patches)
            grids.append(grid)
        return torch.cat(patches), torch.cat(grids)

    def from_pixels(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An RGB image already at a size the patches divide (uint8 [h, w, 3]; h and w multiples of
        patch * merge), normalised and patchified without resizing (no Pillow needed): (pixel_values, grid [1, 3])."""
        h, w, _ = pixels.shape
        factor = self.patch_size * self.merge_size
        if pixels.dtype != torch.uint8 or pixels.shape[2] != 3 or h % factor or w % factor:
            raise ValueError(f"from_pixels takes uint8 [h, w, 3] with h, w multiples of {factor}; got "
                             f"{pixels.dtype} {list(pixels.shape)}")
        x = (pixels.permute(2, 0, 1).double() * (1 / 255)).float()
        x = (x - torch.tensor(self.mean)[:, None, None]) / torch.tensor(self.std)[:, None, None]
        return self._patchify(x), torch.tensor([[1, h // self.patch_size, w // self.patch_size]])

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """No images: (pixel_values [0, 3 * temporal_patch * patch^2], image_grid_thw [0, 3])."""
        return torch.zeros(0, 3 * self.temporal_patch_size * self.patch_size**2), torch.zeros(0, 3, dtype=torch.long)

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        c, h, w = x.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        blocks = x.reshape(c, h // p // m, m, p, w // p // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        frames = blocks[:, :, :, :, :, None].expand(*blocks.shape[:5], t, p, p)  # a still image over t frames
        return frames.reshape((h // p) * (w // p), c * t * p * p)


def load_image(path: str | Path, *, sample: str) -> Image.Image:
    """The decoded image at `path`; ValueError naming `sample` (e.g. "line 12 of train.jsonl") when the
    file is missing or is not an image Pillow can read."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ImportError("reading images needs Pillow: pip install 'titan-models[images]'") from None
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{sample}: image file {str(path)!r} does not exist")
    try:
        with Image.open(path) as image:
            image.load()
            return image.copy()
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"{sample}: image file {str(path)!r} cannot be read as an image ({e})") from None

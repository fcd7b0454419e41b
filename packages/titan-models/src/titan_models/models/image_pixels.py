"""The pixel steps that transformers' torchvision-backed image processors (Kimi K2.x, Muse Glimmer) take,
done with torch alone: an RGB uint8 [3, h, w] tensor from a Pillow image, an antialiased bicubic or Lanczos
resize of the uint8 pixels (torch's CPU uint8 kernels, which torchvision calls on CPU; bicubic for Lanczos
on torch < 2.12, as transformers falls back), zero padding at the bottom and right, and rescale + normalise
fused into one float32 step ((x - 255 mean) / (255 std)).
"""
from __future__ import annotations

import warnings
from functools import cache
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from PIL import Image

RESCALE = 1 / 255


def preprocess_each(from_pixels, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw) of `images`, each through `from_pixels` (uint8 [h, w, 3] -> one image's
    (pixel_values, grid [1, 3])), concatenated in order."""
    out = [from_pixels(rgb_pixels(image).permute(1, 2, 0)) for image in images]
    return torch.cat([p for p, _ in out]), torch.cat([g for _, g in out])


def check_rgb_uint8(pixels: torch.Tensor) -> None:
    if pixels.dtype != torch.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"from_pixels takes uint8 [h, w, 3]; got {pixels.dtype} {list(pixels.shape)}")


def raster_patches(x: torch.Tensor, patch: int) -> torch.Tensor:
    """[3, h, w] (h, w multiples of `patch`) -> [h / patch * w / patch, 3, patch, patch], row by row."""
    grid_h, grid_w = x.shape[1] // patch, x.shape[2] // patch
    return x.reshape(3, grid_h, patch, grid_w, patch).permute(1, 3, 0, 2, 4).reshape(grid_h * grid_w, 3, patch, patch)


def rgb_pixels(image: Image.Image) -> torch.Tensor:
    """uint8 [3, h, w] of `image` converted to RGB (as the processors' do_convert_rgb)."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return data.view(image.height, image.width, 3).permute(2, 0, 1).contiguous()


def resize_uint8(pixels: torch.Tensor, height: int, width: int, mode: Literal["bicubic", "lanczos"]) -> torch.Tensor:
    """uint8 [3, h, w] -> uint8 [3, height, width], antialiased (unchanged when the size is the same), with
    torch's uint8 kernels, as torchvision does on CPU. torch before 2.12 has no Lanczos mode: there Lanczos
    falls back to bicubic, as transformers' torchvision-backed processors do below torchvision 0.27 (the
    release paired with torch 2.12, torchvision pinning its torch), so the pixels still equal theirs."""
    if tuple(pixels.shape[1:]) == (height, width):
        return pixels
    if mode == "lanczos" and not _torch_has_lanczos():
        _warn_lanczos_falls_back()
        mode = "bicubic"
    return F.interpolate(pixels.cpu()[None], size=[height, width], mode=mode, align_corners=False,
                         antialias=True)[0].to(pixels.device)


@cache
def _warn_lanczos_falls_back() -> None:
    warnings.warn(f"torch {torch.__version__} has no Lanczos interpolate (torch >= 2.12 has): resizing bicubic "
                  "instead, as transformers' image processors do with torchvision < 0.27", stacklevel=3)


@cache
def _torch_has_lanczos() -> bool:
    try:
        F.interpolate(torch.zeros(1, 1, 2, 2, dtype=torch.uint8), size=[1, 1], mode="lanczos", antialias=True)
    except (NotImplementedError, ValueError, RuntimeError):
        return False
    return True


def pad_bottom_right(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[3, h, w] -> [3, height, width] with zeros below and to the right."""
    return F.pad(pixels, (0, width - pixels.shape[2], 0, height - pixels.shape[1]))


def normalize(pixels: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 [3, h, w] -> float32 (x - mean / RESCALE) / (std / RESCALE), in float32 as the processors fuse it."""
    mean_255 = (torch.tensor(mean) * (1.0 / RESCALE))[:, None, None]
    std_255 = (torch.tensor(std) * (1.0 / RESCALE))[:, None, None]
    return (pixels.float() - mean_255.to(pixels.device)) / std_255.to(pixels.device)

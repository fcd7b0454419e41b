"""Each vision-language family's image inputs for a data loader: its titan-models preprocessing (the same
`pixel_values` / `image_grid_thw` as its transformers image processor) and the tokens an image takes in a
row, picked by the model config's family.

| family | preprocessing | an image's tokens |
|---|---|---|
| qwen3_vl (and Qwen3-VL-MoE) | qwen3_vl.preprocess | vision start, image tokens, vision end |
| kimi_k25 | kimi_k25.preprocess | vision start (media begin), image tokens, vision end (media end) |
| muse_glimmer (with a tower) | muse_glimmer.preprocess | image start, image tokens, image end (those set) |
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

QWEN_PIXELS = (65536, 16777216)  # Qwen3-VL's processor bounds: data.image_min_pixels / image_max_pixels' defaults
FAMILIES = ("qwen3_vl", "kimi_k25", "muse_glimmer")


@dataclass(frozen=True, kw_only=True)
class ImageInputs:
    """`preprocess(images)` / `preprocess.from_pixels(uint8 [h, w, 3])` -> (pixel_values, image_grid_thw);
    `tokens(grid)` -> the ids one image of that grid takes in a row."""

    preprocess: Any
    merge_size: int
    image_token_id: int
    start_token_id: int | None
    end_token_id: int | None

    def tokens(self, grid: torch.Tensor) -> list[int]:
        count = int(grid.prod()) // self.merge_size**2
        start = [] if self.start_token_id is None else [self.start_token_id]
        end = [] if self.end_token_id is None else [self.end_token_id]
        return start + [self.image_token_id] * count + end

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A text-only row's entry: no patches, no grids (cat over rows then skips it)."""
        return self.preprocess.empty()


def image_inputs(model_config: Any, *, needed_by: str, pixels: tuple[int, int] = QWEN_PIXELS) -> ImageInputs:
    """The image inputs of `model_config`'s family; ValueError naming `needed_by` (the option that asked)
    for a model without a vision tower. `pixels` (min, max) are Qwen3-VL's resize bounds."""
    family = getattr(type(model_config), "family", None)
    if family not in FAMILIES or getattr(model_config, "vision", None) is None:
        raise ValueError(f"{needed_by} needs a vision-language model (--model.family {', '.join(FAMILIES)}; "
                         f"muse_glimmer with --model.flavor debug_vision); {type(model_config).__name__} "
                         f"(family {family}) has no vision tower")
    if not 0 < pixels[0] <= pixels[1]:
        raise ValueError(f"data.image_min_pixels / image_max_pixels must satisfy 0 < min <= max; got {pixels}")
    if family != "qwen3_vl" and tuple(pixels) != QWEN_PIXELS:
        raise ValueError(f"data.image_min_pixels / image_max_pixels bound Qwen3-VL's resizing; {family} resizes by "
                         "its own processor's caps (leave them at their defaults)")
    cfg, vision = model_config, model_config.vision
    if family == "qwen3_vl":
        from titan_models.models.qwen3_vl.preprocess import ImagePreprocessing

        return ImageInputs(preprocess=ImagePreprocessing.for_vision(vision, min_pixels=pixels[0], max_pixels=pixels[1]),
                           merge_size=vision.spatial_merge_size, image_token_id=cfg.image_token_id,
                           start_token_id=cfg.vision_start_token_id, end_token_id=cfg.vision_end_token_id)
    if family == "kimi_k25":
        from titan_models.models.kimi_k25.preprocess import KimiImagePreprocessing

        return ImageInputs(preprocess=KimiImagePreprocessing.for_vision(vision), merge_size=vision.merge_size,
                           image_token_id=cfg.image_token_id, start_token_id=cfg.vision_start_token_id,
                           end_token_id=cfg.vision_end_token_id)
    from titan_models.models.muse_glimmer.preprocess import MuseImagePreprocessing

    return ImageInputs(preprocess=MuseImagePreprocessing.for_vision(vision), merge_size=vision.merge_size,
                       image_token_id=cfg.image_token_id, start_token_id=cfg.image_start_token_id,
                       end_token_id=cfg.image_end_token_id)

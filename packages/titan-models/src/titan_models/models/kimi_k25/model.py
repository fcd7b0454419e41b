"""Kimi K2.x (Kimi-K2.5/K2.6): the DeepSeek-V3 text model with the MoonViT tower and projector in front.

`model(tokens, pixel_values=..., image_grid_thw=...)`: each image's merged tokens replace, in order, the
`image_token_id` tokens of the batch (sample by sample); placeholder ids are embedded as token 0 first, as
transformers does, so they may lie outside the vocabulary. Positions stay 1-D. Without images the call is
the DeepSeek-V3 text model's, bitwise.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from titan_models.components.image_tokens import embed_with_images
from titan_models.context import AttentionContext
from titan_models.models.deepseek_v3.model import DeepSeekV3Config, DeepSeekV3Transformer
from titan_models.models.kimi_k25.vision import KimiVisionConfig, KimiVisionTower
from titan_models.parallel_plan import ParallelPlan


@dataclass(kw_only=True)
class KimiK25Config(DeepSeekV3Config):
    """A DeepSeek-V3 text config plus the vision tower and the image placeholder token."""

    family: ClassVar[str] = "kimi_k25"

    vision: KimiVisionConfig
    image_token_id: int = 163605
    video_token_id: int = 163840  # read and written for the checkpoint; videos are not taken yet
    vision_start_token_id: int = 163602
    vision_end_token_id: int = 163604
    tie_embeddings: bool = True  # Kimi_K25Config's default

    def __post_init__(self) -> None:
        if self.vision.out_dim != self.dim:
            raise ValueError(f"KimiK25Config: vision.out_dim={self.vision.out_dim} must equal dim={self.dim}")

    def text_config(self) -> DeepSeekV3Config:
        """The same text model as a plain DeepSeekV3Config."""
        return DeepSeekV3Config(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DeepSeekV3Config)})

    def _transformer(self, **kwargs) -> "KimiK25Transformer":
        return KimiK25Transformer(visual=self.vision.build(), **kwargs)

    def parallel_plan(self) -> ParallelPlan:
        plan = super().parallel_plan()
        # the tower is small beside the decoder: every rank keeps it whole
        return dataclasses.replace(plan, tensor_parallel=plan.tensor_parallel | {"visual": "replicate"})


class KimiK25Transformer(DeepSeekV3Transformer):
    """A DeepSeek-V3 Transformer whose calls also take `pixel_values` [patches, 3, patch, patch] and
    `image_grid_thw` [images, 3] (what transformers' Kimi K2.5 image processor makes)."""

    def __init__(self, *, visual: KimiVisionTower, **kwargs):
        super().__init__(**kwargs)
        self.visual = visual

    def forward(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                context: AttentionContext | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        h = self.hidden_states(tokens, positions=positions, context=context, pixel_values=pixel_values,
                               image_grid_thw=image_grid_thw)
        return self.output(h) if self.output is not None else h

    def hidden_states(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                      context: AttentionContext | None = None, pixel_values: torch.Tensor | None = None,
                      image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        if pixel_values is None and image_grid_thw is None:
            return self._trunk(tokens, positions, context)[0]  # the text model's path
        if pixel_values is None or image_grid_thw is None:
            raise ValueError("pass pixel_values and image_grid_thw together (both or neither)")
        h = embed_with_images(self, tokens, pixel_values, image_grid_thw, merge=self.config.vision.merge_size)
        return self._blocks(h, positions, context)[0]

    def pipeline_stage(self, layer_names: tuple[str, ...], *, first: bool, last: bool) -> "KimiK25Transformer":
        stage = super().pipeline_stage(layer_names, first=first, last=last)
        stage.visual = self.visual if first else None  # images enter with the embeddings
        return stage

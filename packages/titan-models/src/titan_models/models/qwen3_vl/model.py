"""Qwen3-VL: the Qwen3 text model (same blocks, interleaved MRoPE) with the vision tower in front.

`model(tokens, pixel_values=..., image_grid_thw=...)`: each image's merged tokens replace, in order, the
`image_token_id` tokens of the sequence; DeepStack features are added to those positions after the first
text layers (one layer per feature); positions default to the 3-D MRoPE positions of the tokens. Without
images the call is the text model's, bitwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from titan_models.components.mrope import MRopeConfig
from titan_models.context import AttentionContext
from titan_models.models.qwen3.model import Qwen3Config
from titan_models.models.qwen3_vl.positions import image_token_counts, mrope_positions
from titan_models.models.qwen3_vl.vision import VisionConfig, VisionTower
from titan_models.models.transformer import Transformer, default_dtype
from titan_models.parallel_plan import ParallelPlan


@dataclass(kw_only=True)
class Qwen3VLConfig(Qwen3Config):
    """A Qwen3 text config (dense, or MoE for Qwen3-VL-MoE) plus the vision tower and the image token."""

    family: ClassVar[str] = "qwen3_vl"

    vision: VisionConfig
    image_token_id: int
    video_token_id: int  # read and written for the checkpoint; videos are not taken yet
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_sections: tuple[int, int, int] = (24, 20, 20)

    def __post_init__(self) -> None:
        if self.vision.out_dim != self.dim:
            raise ValueError(f"Qwen3VLConfig: vision.out_dim={self.vision.out_dim} must equal dim={self.dim}")
        if len(self.vision.deepstack_layers) > self.num_layers:
            raise ValueError(f"Qwen3VLConfig: {len(self.vision.deepstack_layers)} DeepStack features need as "
                             f"many text layers; num_layers={self.num_layers}")
        if not 0 <= self.image_token_id < self.vocab_size:
            raise ValueError(f"Qwen3VLConfig.image_token_id={self.image_token_id} is outside the vocabulary "
                             f"(vocab_size={self.vocab_size})")

    def parallel_plan(self) -> ParallelPlan:
        plan = super().parallel_plan()
        # the tower is small beside the decoder: every rank keeps it whole
        return ParallelPlan(tensor_parallel=plan.tensor_parallel | {"visual": "replicate"}, experts=plan.experts,
                            moe=plan.moe, pipeline_cut_points=plan.pipeline_cut_points,
                            activation_checkpoint_unit=plan.activation_checkpoint_unit, tp_divides=plan.tp_divides)

    def build(self) -> "Qwen3VLTransformer":
        rope = MRopeConfig(dim=self.head_dim, theta=self.rope_theta, sections=self.mrope_sections)
        with default_dtype(self.dtype):
            return Qwen3VLTransformer(
                config=self, vocab_size=self.vocab_size, dim=self.dim, blocks=self.build_blocks(),
                norm=self.norm.build(self.dim), rope=rope.build(), tie_embeddings=self.tie_embeddings,
                parallel_plan=self.parallel_plan(), visual=self.vision.build())


class Qwen3VLTransformer(Transformer):
    """A Transformer whose calls also take `pixel_values` [patches, patch_dim] and `image_grid_thw`
    [images, 3] (titan_models.models.qwen3_vl.preprocess makes both), and videos as transformers' video
    processor makes them: `pixel_values_videos` [patches, patch_dim] and `video_grid_thw` [videos, 3]
    (t temporal patches each), whose merged tokens replace the `video_token_id` tokens frame by frame."""

    def __init__(self, *, visual: VisionTower, **kwargs):
        super().__init__(**kwargs)
        self.visual = visual

    def forward(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                context: AttentionContext | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
                video_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        h = self.hidden_states(tokens, positions=positions, context=context, pixel_values=pixel_values,
                               image_grid_thw=image_grid_thw, pixel_values_videos=pixel_values_videos,
                               video_grid_thw=video_grid_thw)
        return self.output(h) if self.output is not None else h

    def hidden_states(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                      context: AttentionContext | None = None, pixel_values: torch.Tensor | None = None,
                      image_grid_thw: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
                      video_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("pass pixel_values and image_grid_thw together (both or neither)")
        if (pixel_values_videos is None) != (video_grid_thw is None):
            raise ValueError("pass pixel_values_videos and video_grid_thw together (both or neither)")
        if pixel_values is None and pixel_values_videos is None:
            return self._trunk(tokens, positions, context)[0]  # the text model's path
        if self.tok_embeddings is None:
            raise ValueError("images go to the first pipeline stage (the one holding tok_embeddings)")
        return self._image_trunk(tokens, positions, context, (pixel_values, image_grid_thw),
                                 (pixel_values_videos, video_grid_thw))

    def _image_trunk(self, tokens: torch.Tensor, positions: torch.Tensor | None, context: AttentionContext | None,
                     images: tuple[torch.Tensor | None, torch.Tensor | None],
                     videos: tuple[torch.Tensor | None, torch.Tensor | None]) -> torch.Tensor:
        cfg = self.config
        merge = cfg.vision.spatial_merge_size
        if positions is None:  # also checks every sample's image and video tokens against its grids
            positions, _ = mrope_positions(tokens, images[1], image_token_id=cfg.image_token_id,
                                           spatial_merge_size=merge, video_grid_thw=videos[1],
                                           video_token_id=cfg.video_token_id)
        h = self.tok_embeddings(tokens)
        kinds = [(pixels, grid_thw, tokens == token_id, name) for (pixels, grid_thw), token_id, name in
                 ((images, cfg.image_token_id, "image"), (videos, cfg.video_token_id, "video")) if pixels is not None]
        visual = kinds[0][2] if len(kinds) == 1 else kinds[0][2] | kinds[1][2]  # image or video positions
        # The visual positions as flat indices (and each kind's among them), found once and before the tower's
        # work is queued, so that their host sync waits for nothing: a boolean index per DeepStack layer
        # (forward and backward) each cost a sync behind the queued work.
        where = visual.flatten().nonzero().squeeze(1) if cfg.vision.deepstack_layers else None
        places = ([mask.flatten()[where].nonzero().squeeze(1) for _, _, mask, _ in kinds]
                  if len(kinds) > 1 and where is not None else [])
        deepstacks = []
        for pixels, grid_thw, mask, name in kinds:
            if int(mask.sum()) != sum(image_token_counts(grid_thw, merge)):
                raise ValueError(f"the tokens hold {int(mask.sum())} {name} tokens; {name}_grid_thw "
                                 f"{grid_thw.tolist()} makes {sum(image_token_counts(grid_thw, merge))}")
            merged, deepstack = self.visual(pixels, grid_thw)
            h = h.masked_scatter(mask[..., None], merged.to(h.dtype))
            deepstacks.append(deepstack)
        # each DeepStack layer's features of images and videos, placed as their tokens lie in the sequence
        features = deepstacks[0] if len(deepstacks) == 1 else []  # one kind: already in sequence order
        for per_kind in zip(*deepstacks) if len(deepstacks) > 1 else ():
            joint = per_kind[0].new_zeros(len(where), per_kind[0].shape[-1])
            for place, feature in zip(places, per_kind):
                joint = joint.index_put((place,), feature)
            features.append(joint)
        rope = tuple(t.to(h.dtype) for t in self.rope(positions))
        for i, block in enumerate(self.layers.values()):
            h = block(h, rope, context=context)
            if i < len(features):
                flat = h.flatten(0, 1)
                h = flat.index_put((where,), flat[where] + features[i].to(h.dtype)).view_as(h)
        return self.norm(h) if self.norm is not None else h

"""Muse Glimmer: a dense decoder with four norms per layer (zero-centred pre and post norms around
attention and the SwiGLU), scaleless QK-norm with the query scaled by `qk_scale_factor`, a sigmoid
output gate from its own projection, 3 sliding-window : 1 full-attention layers (the full ones without
RoPE), RMS-normed embeddings, a plain-weight final norm and logits `softcap * tanh(l * m / softcap)`
(m = `output_multiplier`). `MuseTextConfig` holds what Muse Spark (models/muse_spark) shares."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from titan_models.components.attention import AttentionBackend, AttentionConfig
from titan_models.components.image_tokens import embed_with_images
from titan_models.components.ffn import FeedForwardConfig
from titan_models.components.layer_types import FULL_ATTENTION, check_layer_types
from titan_models.components.norms import (
    NormConfig, RMSNormConfig, ScalelessRMSNormConfig, ZeroCenteredRMSNormConfig,
)
from titan_models.components.rope import RopeConfig
from titan_models.context import AttentionContext
from titan_models.model_config import ModelConfigBase, SharedHeadDim
from titan_models.models.muse_glimmer.vision import MuseVisionConfig, MuseVisionTower
from titan_models.models.transformer import Transformer, TransformerBlock, default_dtype
from titan_models.parallel_plan import GQA_ATTENTION, ParallelPlan, decoder_plan

SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (SLIDING_ATTENTION, FULL_ATTENTION)


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """Full attention on every 4th layer counted backward from the last, sliding elsewhere (HF's default)."""
    return tuple(FULL_ATTENTION if (num_layers - 1 - i) % 4 == 0 else SLIDING_ATTENTION for i in range(num_layers))


@dataclass(kw_only=True)
class MuseTextConfig(SharedHeadDim, ModelConfigBase):
    """The Muse text decoder's shared fields. `nope_layers` lists the layers without RoPE (None: the
    layers HF's `layer_rope_theta` default leaves without RoPE, every 4th from the last; non-zero per-layer
    thetas mean the global one, as transformers reads them)."""

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 128
    ffn_dim: int = 0
    layer_types: tuple[str, ...] | None = None
    nope_layers: tuple[int, ...] | None = None
    sliding_window: int = 2048
    rms_norm_eps: float = 1e-5
    post_norm_eps: float = 1e-8
    qk_scale_factor: float = 3.87
    output_multiplier: float = 0.19611613513818404
    logit_softcap: float | None = 20.0
    rope_theta: float = 10_000.0
    max_seq_len: int = 131_072
    tie_embeddings: bool = False
    attention: AttentionBackend = "sdpa"
    dtype: torch.dtype = torch.float32
    # a composite checkpoint's fields besides text_config (vision/audio sub-configs, image token ids):
    # not built, kept so that to_hf writes the same composite config back
    hf_multimodal: dict[str, Any] | None = field(default=None, compare=False)

    def layer_kinds(self) -> tuple[str, ...]:
        if self.layer_types is None:
            return default_layer_types(self.num_layers)
        return check_layer_types(self.layer_types, num_layers=self.num_layers, allowed=LAYER_TYPES)

    def resolved_nope_layers(self) -> tuple[int, ...]:
        if self.nope_layers is None:  # HF's default: every 4th layer from the last, whatever layer_types says
            return tuple(i for i, kind in enumerate(default_layer_types(self.num_layers)) if kind == FULL_ATTENTION)
        return tuple(self.nope_layers)

    def with_num_layers(self, n: int) -> "MuseTextConfig":
        """The first n layers with their attention kinds and NoPE layers."""
        kinds = self.layer_kinds()[:n]
        return dataclasses.replace(self, num_layers=n, layer_types=kinds,
                                   nope_layers=tuple(i for i in self.resolved_nope_layers() if i < n))

    def _validate(self) -> None:
        self.layer_kinds()
        bad = sorted(i for i in self.resolved_nope_layers() if not 0 <= i < self.num_layers)
        if bad:
            raise ValueError(f"nope_layers holds layers {bad} outside [0, num_layers={self.num_layers})")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.qk_scale_factor <= 0:
            raise ValueError(f"qk_scale_factor must be positive, got {self.qk_scale_factor}")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be positive or None, got {self.logit_softcap}")

    def attention_config(self, i: int, *, output_norm: NormConfig | None = None) -> AttentionConfig:
        sliding = self.layer_kinds()[i] == SLIDING_ATTENTION
        return AttentionConfig(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                               qk_norm=ScalelessRMSNormConfig(eps=self.rms_norm_eps), output_gate=True,
                               output_gate_source="projection", rotary=i not in self.resolved_nope_layers(),
                               query_scale=self.qk_scale_factor, output_norm=output_norm, backend=self.attention,
                               sliding_window=self.sliding_window if sliding else None)

    def centred_norm(self, eps: float | None = None) -> ZeroCenteredRMSNormConfig:
        return ZeroCenteredRMSNormConfig(eps=self.rms_norm_eps if eps is None else eps)

    def transformer(self, blocks: list[TransformerBlock], *, model_type: type = Transformer, **extra) -> Transformer:
        """The decoder around `blocks`: normed embeddings, plain final norm, scaled and soft-capped logits
        (`model_type` and `extra`: a subclass with more modules, Glimmer's vision tower)."""
        return model_type(**extra, config=self, vocab_size=self.vocab_size, dim=self.dim, blocks=blocks,
                           norm=RMSNormConfig(eps=self.rms_norm_eps).build(self.dim),
                           rope=RopeConfig(dim=self.head_dim, theta=self.rope_theta).build(),
                           tie_embeddings=self.tie_embeddings, parallel_plan=self.parallel_plan(),
                           embedding_norm=ScalelessRMSNormConfig(eps=self.rms_norm_eps).build(self.dim),
                           logit_scale=self.output_multiplier, logit_softcap=self.logit_softcap)


MUSE_ATTENTION = GQA_ATTENTION | {"wg": "colwise"}


@dataclass(kw_only=True)
class MuseGlimmerConfig(MuseTextConfig):
    family: ClassVar[str] = "muse_glimmer"

    # the vision tower, adapter and projection (None: the text model only)
    vision: MuseVisionConfig | None = None
    image_token_id: int | None = None  # needed with `vision`
    video_token_id: int | None = None  # embedded as token 0 like image tokens; videos are not taken yet
    # the tokenizer's <|image_start|> / <|image_end|>, which transformers' processor puts around each image's
    # tokens (HF's config does not hold them; None: image-text data writes an image's tokens without them)
    image_start_token_id: int | None = None
    image_end_token_id: int | None = None

    @property
    def moe(self) -> None:  # every layer is dense
        return None

    def _validate(self) -> None:
        super()._validate()
        if self.ffn_dim < 1:
            raise ValueError(f"ffn_dim must be positive, got {self.ffn_dim}")
        if self.vision is not None and (self.vision.out_dim != self.dim or self.image_token_id is None):
            raise ValueError(f"MuseGlimmerConfig: with a vision tower, vision.out_dim={self.vision.out_dim} must equal "
                             f"dim={self.dim} and image_token_id (got {self.image_token_id}) must be set")

    def build(self) -> Transformer:
        self._validate()
        post = self.centred_norm(self.post_norm_eps)
        with default_dtype(self.dtype):
            blocks = [TransformerBlock(attention=self.attention_config(i).build(self.dim),
                                       attention_norm=self.centred_norm().build(self.dim),
                                       post_attention_norm=post.build(self.dim),
                                       ffn_norm=self.centred_norm().build(self.dim),
                                       feed_forward=FeedForwardConfig(hidden_dim=self.ffn_dim).build(self.dim),
                                       post_ffn_norm=post.build(self.dim))
                      for i in range(self.num_layers)]
            if self.vision is None:
                return self.transformer(blocks)
            return self.transformer(blocks, model_type=MuseGlimmerTransformer, visual=self.vision.build())

    def parallel_plan(self) -> ParallelPlan:
        plan = decoder_plan(num_layers=self.num_layers, attention=MUSE_ATTENTION)
        # post-branch norms sit between a rowwise projection's local output and the residual sum: whole weights
        # computed on each rank's sequence shard ("replicate", gradients summed over the TP ranks)
        tp = plan.tensor_parallel | {"layers.*.post_attention_norm": "replicate", "layers.*.post_ffn_norm": "replicate"}
        if self.vision is not None:  # the tower is small beside the decoder: every rank keeps it whole
            tp |= {"visual": "replicate"}
        return dataclasses.replace(plan, tensor_parallel=tp)


class MuseGlimmerTransformer(Transformer):
    """Muse Glimmer with its vision tower: calls also take `pixel_values` [patches, patch_dim] and
    `image_grid_thw` [images, 3]; each image's tokens replace, in order, the `image_token_id` tokens (placeholders
    embedded as token 0 first, as transformers does). Without images the call is the text model's, bitwise."""

    def __init__(self, *, visual: MuseVisionTower, **kwargs):
        super().__init__(**kwargs)
        self.visual = visual

    def forward(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                context: AttentionContext | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        h = self.hidden_states(tokens, positions=positions, context=context, pixel_values=pixel_values,
                               image_grid_thw=image_grid_thw)
        return self.logits(self.output(h)) if self.output is not None else h

    def hidden_states(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                      context: AttentionContext | None = None, pixel_values: torch.Tensor | None = None,
                      image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        if pixel_values is None and image_grid_thw is None:
            return self._trunk(tokens, positions, context)[0]  # the text model's path
        if pixel_values is None or image_grid_thw is None:
            raise ValueError("pass pixel_values and image_grid_thw together (both or neither)")
        h = embed_with_images(self, tokens, pixel_values, image_grid_thw, merge=self.config.vision.merge_size)
        return self._blocks(h, positions, context)[0]

    def pipeline_stage(self, layer_names: tuple[str, ...], *, first: bool, last: bool) -> "MuseGlimmerTransformer":
        stage = super().pipeline_stage(layer_names, first=first, last=last)
        stage.visual = self.visual if first else None  # images enter with the embeddings
        return stage

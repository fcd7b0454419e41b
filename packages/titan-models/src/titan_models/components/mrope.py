"""Multimodal RoPE (Qwen3-VL's interleaved MRoPE): each token has a (temporal, height, width) position and
the rotary frequency channels are dealt round-robin to the three axes: channel j follows height when
j % 3 == 1 and j < 3 * sections[1], width when j % 3 == 2 and j < 3 * sections[2], time otherwise.

Text tokens carry the same position on all three axes, so for them MRoPE is plain RoPE: positions [b, s]
take the plain path unchanged (text-only calls equal the text model bitwise); [3, b, s] take the 3-D one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_models.components.rope import RopeConfig, RotaryEmbedding


@dataclass(kw_only=True, frozen=True)
class MRopeConfig(RopeConfig):
    sections: tuple[int, int, int] = (24, 20, 20)  # frequency channels per axis (t, h, w); sum = dim / 2

    def __post_init__(self) -> None:
        if sum(self.sections) != self.dim // 2:
            raise ValueError(f"MRopeConfig.sections={list(self.sections)} must sum to dim/2={self.dim // 2}")

    def build(self) -> "MultimodalRotaryEmbedding":
        return MultimodalRotaryEmbedding(self)


class MultimodalRotaryEmbedding(RotaryEmbedding):
    """positions [b, s] (text) or [3, b, s] (t, h, w) -> (cos, sin) [b, s, dim] in float32."""

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.ndim == 2:
            return super().forward(positions)
        if positions.ndim != 3 or positions.shape[0] != 3:
            raise ValueError(f"MRoPE positions must be [batch, seq] or [3, batch, seq]; got {list(positions.shape)}")
        freqs = positions[..., None].float() * self.inv_freq.float()  # [3, b, s, dim/2]
        channel = torch.arange(freqs.shape[-1], device=freqs.device)
        _, h_sec, w_sec = self.config.sections
        # torch.where, not boolean-mask writes: those find their indices on the host (a sync each)
        axis = torch.where((channel % 3 == 1) & (channel < 3 * h_sec), 1, 0)
        axis = torch.where((channel % 3 == 2) & (channel < 3 * w_sec), 2, axis)
        mixed = freqs.gather(0, axis.expand(1, *freqs.shape[1:]))[0]  # [b, s, dim/2]
        angles = torch.cat((mixed, mixed), dim=-1)
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor

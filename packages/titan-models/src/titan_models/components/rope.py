"""Rotary position embedding (RoPE) with Llama 3 and YaRN frequency scaling.

Layout follows Hugging Face's "rotate_half" convention: the rotated pairs are (x[i], x[i + d/2]),
so Hugging Face weights load without permuting q/k rows. `interleaved=True` instead rotates the
pairs (x[2i], x[2i+1]) (DeepSeek's original layout); its output is written de-interleaved
(evens then odds) as Hugging Face does. q and k get the same treatment, so q.k is unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(kw_only=True, frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's piecewise frequency scaling (long wavelengths divided by `factor`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def scale(self, inv_freq: torch.Tensor, *, theta: float) -> torch.Tensor:
        del theta  # the wavelengths already encode it
        low_freq_wavelen = self.original_max_seq_len / self.low_freq_factor
        high_freq_wavelen = self.original_max_seq_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_seq_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)

    def attention_factor(self) -> float:
        return 1.0


@dataclass(kw_only=True, frozen=True)
class YarnRopeScaling:
    """YaRN (arXiv 2309.00071) as DeepSeek-V3 uses it.

    Two magnitudes: `attention_factor()` multiplies cos/sin, and `softmax_scale_factor()` multiplies
    the attention softmax scale (DeepSeek's mscale_all_dim term, applied as mscale**2).
    """

    factor: float
    original_max_seq_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    explicit_attention_factor: float | None = None  # HF's `attention_factor`, overriding the mscale ratio

    @staticmethod
    def _mscale(factor: float, mscale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    def scale(self, inv_freq: torch.Tensor, *, theta: float) -> torch.Tensor:
        dim = 2 * inv_freq.numel()

        def correction_dim(num_rotations: float) -> float:
            # The rotary channel whose wavelength fits `num_rotations` times into the original context.
            return (dim * math.log(self.original_max_seq_len / (num_rotations * 2 * math.pi))) / (
                2 * math.log(theta)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        # Fast-rotating channels (ramp 0) keep their frequency; slow ones (ramp 1) are interpolated.
        return (inv_freq / self.factor) * ramp + inv_freq * (1 - ramp)

    def attention_factor(self) -> float:
        if self.explicit_attention_factor is not None:
            return self.explicit_attention_factor
        if self.mscale and self.mscale_all_dim:
            return self._mscale(self.factor, self.mscale) / self._mscale(self.factor, self.mscale_all_dim)
        return self._mscale(self.factor, 1.0)

    def softmax_scale_factor(self) -> float:
        if not self.mscale_all_dim:
            return 1.0
        return self._mscale(self.factor, self.mscale_all_dim) ** 2


RopeScaling = Llama3RopeScaling | YarnRopeScaling


@dataclass(kw_only=True, frozen=True)
class RopeConfig:
    """`dim` is the number of rotated channels per head (the head dim, MLA's rope part, or the
    rotated leading part of a head under partial rotary embedding)."""

    dim: int
    theta: float = 10000.0
    scaling: RopeScaling | None = None
    interleaved: bool = False

    def build(self) -> "RotaryEmbedding":
        return RotaryEmbedding(self)


class RotaryEmbedding(nn.Module):
    """Turns positions [batch, seq] into (cos, sin) [batch, seq, dim] in float32."""

    def __init__(self, config: RopeConfig):
        super().__init__()
        if config.dim % 2:
            raise ValueError(f"RopeConfig.dim must be even, got {config.dim}")
        self.config = config
        # Not persistent: derived from the config, so checkpoints and HF files never carry it.
        # Computed on CPU, then placed where modules are being built (meta under `torch.device("meta")`).
        ambient = torch.empty(()).device
        self.register_buffer("inv_freq", self._inv_freq().to(ambient), persistent=False)
        self.attention_factor = 1.0 if config.scaling is None else config.scaling.attention_factor()

    def _inv_freq(self) -> torch.Tensor:
        cfg = self.config
        with torch.device("cpu"):  # real values even while modules are built on meta
            exponents = torch.arange(0, cfg.dim, 2, dtype=torch.int64).float() / cfg.dim
            inv_freq = 1.0 / (cfg.theta**exponents)
            if cfg.scaling is not None:
                inv_freq = cfg.scaling.scale(inv_freq, theta=cfg.theta)
        return inv_freq

    def reset_buffers(self) -> None:
        """Recompute `inv_freq` (needed after building on meta and `to_empty`)."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.float()  # [b, s, dim/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [b, s, dim]
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> torch.Tensor:
    """x [b, s, heads, dim]; cos/sin [b, s, rot] (float32, cast to x's dtype as HF does).

    Partial rotary embedding: when rot < dim only the first rot channels of each head rotate and
    the rest pass through (Qwen3-Next / Qwen3.5's `partial_rotary_factor`)."""
    rotated = cos.shape[-1]
    if rotated < x.shape[-1]:
        head = apply_rotary(x[..., :rotated], cos, sin, interleaved=interleaved)
        return torch.cat((head, x[..., rotated:]), dim=-1)
    cos = cos.to(x.dtype).unsqueeze(2)
    sin = sin.to(x.dtype).unsqueeze(2)
    if not interleaved:
        return x * cos + rotate_half(x) * sin
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)

"""The Qwen3-VL vision tower: Conv3d patch embedding over (temporal x spatial) patches, a learned position
table resampled bilinearly to each image's grid, 2-D rotary positions, full (non-causal) attention within
each image, a 2x2 spatial merge into text-width tokens, and DeepStack features taken after some blocks.

Input is what the image processor makes (titan_models.models.qwen3_vl.preprocess): `pixel_values`
[patches, channels * temporal_patch * patch * patch], the patches of each image in spatial-merge-block
order (each merge x merge block of neighbouring patches consecutive), and `grid_thw` [images, 3] in patches.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, frozen=True)
class VisionConfig:
    depth: int
    dim: int
    ffn_dim: int
    num_heads: int
    out_dim: int  # the text model's width: merged tokens and DeepStack features have it
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304  # a square table: side = sqrt of it
    deepstack_layers: tuple[int, ...] = (8, 16, 24)  # blocks whose outputs feed the first text layers
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 4:
            raise ValueError(f"VisionConfig: dim={self.dim} must split into num_heads={self.num_heads} heads "
                             "whose width is a multiple of 4 (two rotary axes of cos/sin pairs)")
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"VisionConfig.num_position_embeddings={self.num_position_embeddings} must be a square")
        bad = [i for i in self.deepstack_layers if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"VisionConfig.deepstack_layers {bad} are not blocks of a depth-{self.depth} tower")

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def build(self) -> "VisionTower":
        return VisionTower(self)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.wo = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)  # each [n, heads, head_dim]
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        # Each image attends only within itself. Images of one size in a row go through one batched call
        # (the same per-image attention, bitwise): a call per image made the step launch-bound on many
        # small images (128 images x 24 blocks, forward and backward).
        out, start = [], 0
        for length, count in _equal_runs(lengths):
            end = start + length * count
            qi, ki, vi = (t[start:end].view(count, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
            out.append(F.scaled_dot_product_attention(qi, ki, vi).transpose(1, 2).reshape(end - start, -1))
            start = end
        return self.wo(out[0] if len(out) == 1 else torch.cat(out))


def _equal_runs(lengths: list) -> list[tuple]:
    """[(length, count)]: the runs of consecutive equal lengths (or grids), in order."""
    runs: list[tuple] = []
    for length in lengths:
        if runs and runs[-1][0] == length:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    return runs


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32 (as the reference does for the tower), back in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim)
        self.w2 = nn.Linear(config.ffn_dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.attention = VisionAttention(config)
        self.ffn_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = VisionMLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, lengths)
        return x + self.feed_forward(self.ffn_norm(x))


class PatchMerger(nn.Module):
    """merge x merge neighbouring patches -> one token of the text width. The main merger norms each
    patch before concatenating them; the DeepStack mergers (`norm_after_merge`) norm the concatenation."""

    def __init__(self, config: VisionConfig, *, norm_after_merge: bool):
        super().__init__()
        self.merged_dim = config.dim * config.spatial_merge_size**2
        self.norm_after_merge = norm_after_merge
        self.norm = nn.LayerNorm(self.merged_dim if norm_after_merge else config.dim, eps=config.norm_eps)
        self.w1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.w2 = nn.Linear(self.merged_dim, config.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.merged_dim)) if self.norm_after_merge else self.norm(x).reshape(-1, self.merged_dim)
        return self.w2(F.gelu(self.w1(x)))


class VisionTower(nn.Module):
    """`tower(pixel_values, grid_thw) -> (tokens [merged patches, out_dim], DeepStack features, one per
    deepstack layer, each [merged patches, out_dim])`."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.patch_embed = nn.Conv3d(config.in_channels, config.dim, kernel_size=kernel, stride=kernel)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.dim)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config, norm_after_merge=False)
        self.deepstack_mergers = nn.ModuleList(
            [PatchMerger(config, norm_after_merge=True) for _ in config.deepstack_layers])
        head_dim = config.dim // config.num_heads
        # Not persistent: derived from the config. One frequency per cos/sin pair of one axis (head_dim / 4).
        exponents = torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device="cpu") / (head_dim // 2)
        ambient = torch.empty(()).device
        self.register_buffer("inv_freq", (1.0 / config.rope_theta**exponents).to(ambient), persistent=False)

    def reset_buffers(self) -> None:
        head_dim = self.config.dim // self.config.num_heads
        exponents = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        self.inv_freq = (1.0 / self.config.rope_theta**exponents).to(self.inv_freq.device)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cfg = self.config
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        lengths = [t * h * w for t, h, w in grids]
        if pixel_values.shape != (sum(lengths), cfg.patch_dim):
            raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}; image_grid_thw {grids} needs "
                             f"[{sum(lengths)}, {cfg.patch_dim}] (patches x channels*temporal*patch*patch)")
        frames = [h * w for t, h, w in grids for _ in range(t)]  # a video's frames attend each within itself
        weight = self.patch_embed.weight
        x = pixel_values.to(weight.dtype).view(-1, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        x = self.patch_embed(x).view(-1, cfg.dim)
        rows, cols, heights, widths = _grid_coords(grids, cfg.spatial_merge_size, x.device)
        x = x + self._position_table(rows, cols, heights, widths).to(x.dtype)
        freqs = torch.cat((rows[:, None].float() * self.inv_freq, cols[:, None].float() * self.inv_freq), dim=-1)
        angles = torch.cat((freqs, freqs), dim=-1)
        rope = (angles.cos(), angles.sin())
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, frames)
            if i in cfg.deepstack_layers:
                deepstack.append(self.deepstack_mergers[cfg.deepstack_layers.index(i)](x))
        return self.merger(x), deepstack

    def _position_table(self, rows: torch.Tensor, cols: torch.Tensor, heights: torch.Tensor, widths: torch.Tensor
                        ) -> torch.Tensor:
        """The learned side x side table resampled (bilinear, corners aligned) to each image's h x w grid,
        in block order, repeated over the t frames: [patches, dim] (the arguments: _grid_coords')."""
        side = round(self.config.num_position_embeddings**0.5)
        r_taps, r_weights = _bilinear_taps(rows, heights, side)
        c_taps, c_weights = _bilinear_taps(cols, widths, side)
        index = (r_taps[:, :, None] * side + c_taps[:, None, :]).reshape(-1, 4)
        weights = (r_weights[:, :, None] * c_weights[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * weights[:, :, None].to(self.pos_embed.weight.dtype)).sum(1)


def _grid_coords(grids: list[tuple[int, int, int]], merge: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, col, image height, image width) of every patch, images one after another, frames repeated,
    merge x merge blocks consecutive: made on the host from each distinct grid's (cached) coordinates and
    moved in one copy, as a few operators whatever the number of images (it was several per image)."""
    # a run of images of one grid repeats its frame's coordinates (one host op per run, not per image)
    coords = torch.cat([_block_coords(h, w, merge).repeat(1, t * count) for (t, h, w), count in _equal_runs(grids)],
                       dim=1)
    return coords.to(device).unbind(0)


@functools.lru_cache(maxsize=64)
def _block_coords(h: int, w: int, merge: int) -> torch.Tensor:
    """[4, h * w] on the host: (row, col, h, w) of one h x w frame's patches in block order."""
    r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    block = (h // merge, merge, w // merge, merge)
    rows, cols = (t.reshape(block).transpose(1, 2).flatten() for t in (r, c))
    return torch.stack((rows, cols, torch.full_like(rows, h), torch.full_like(rows, w)))


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table rows (and their weights) a target index among `size` samples reads, corners aligned."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights

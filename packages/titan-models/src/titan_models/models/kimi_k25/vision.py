"""Kimi K2.x's vision tower (MoonViT) and projector: Conv2d patch embedding, a learned h x w position table
resampled bicubically (half-pixel centres) to each image's grid, 2-D rotary positions on (column, row)
pairs, full attention within each image, a final LayerNorm, then each 2x2 block of patches merged and
projected (LayerNorm, Linear, GELU, Linear) to the text width.

Input is what transformers' Kimi K2.5 image processor makes: `pixel_values` [patches, 3, patch, patch], each
image's patches in raster order, and `grid_thw` [images, 3] in patches (t = 1 for images). The fused `wqkv`
keeps the checkpoint's layout, whose query/key head channels come in (real, imaginary) pairs: the rotation
here acts on neighbouring pairs, so the weights need no permutation either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, frozen=True)
class KimiVisionConfig:
    depth: int
    dim: int
    ffn_dim: int
    num_heads: int
    out_dim: int  # the text model's width: merged tokens have it
    patch_size: int = 14
    pos_emb_size: int = 64  # the learned table is pos_emb_size x pos_emb_size
    merge_size: int = 2  # merge_size x merge_size patches -> one text token
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    projector_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 4:
            raise ValueError(f"KimiVisionConfig: dim={self.dim} must split into num_heads={self.num_heads} heads "
                             "whose width is a multiple of 4 (two rotary axes of cos/sin pairs)")

    def build(self) -> "KimiVisionTower":
        return KimiVisionTower(self)


class KimiVisionAttention(nn.Module):
    def __init__(self, config: KimiVisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.wqkv = nn.Linear(config.dim, 3 * config.dim)
        self.wo = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_heads(x)
        q, k = _rotate_pairs(q, *rope), _rotate_pairs(k, *rope)
        # each image attends only within itself
        out = [F.scaled_dot_product_attention(qi.transpose(0, 1)[None], ki.transpose(0, 1)[None],
                                              vi.transpose(0, 1)[None])[0].transpose(0, 1)
               for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        return self.wo(torch.cat(out).reshape(n, -1))

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.wqkv(x).reshape(x.shape[0], 3, self.num_heads, -1).unbind(1)  # each [n, heads, head_dim]


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on neighbouring channel pairs (2i, 2i+1) in float32, back in x's dtype; cos/sin [n, head_dim / 2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]
    return torch.stack((real * cos - imag * sin, imag * cos + real * sin), dim=-1).flatten(-2).to(x.dtype)


class KimiVisionMLP(nn.Module):
    def __init__(self, config: KimiVisionConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim)
        self.w2 = nn.Linear(config.ffn_dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class KimiVisionBlock(nn.Module):
    def __init__(self, config: KimiVisionConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.attention = KimiVisionAttention(config)
        self.ffn_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = KimiVisionMLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, lengths)
        return x + self.feed_forward(self.ffn_norm(x))


class KimiProjector(nn.Module):
    """merge x merge patches (each normed) concatenated -> Linear, exact GELU, Linear to the text width."""

    def __init__(self, config: KimiVisionConfig):
        super().__init__()
        self.merged_dim = config.dim * config.merge_size**2
        self.norm = nn.LayerNorm(config.dim, eps=config.projector_norm_eps)
        self.w1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.w2 = nn.Linear(self.merged_dim, config.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(self.norm(x).reshape(-1, self.merged_dim))))


class KimiVisionTower(nn.Module):
    """`tower(pixel_values, grid_thw) -> image tokens [sum of h * w / merge**2, out_dim]`, images in order."""

    def __init__(self, config: KimiVisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = nn.Conv2d(3, config.dim, kernel_size=config.patch_size, stride=config.patch_size)
        self.pos_embed = nn.Parameter(torch.empty(config.pos_emb_size, config.pos_emb_size, config.dim))
        self.blocks = nn.ModuleList([KimiVisionBlock(config) for _ in range(config.depth)])
        self.norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.projector = KimiProjector(config)
        head_dim = config.dim // config.num_heads
        ambient = torch.empty(()).device
        self.register_buffer("inv_freq", _inv_freq(head_dim, config.rope_theta).to(ambient), persistent=False)

    def reset_buffers(self) -> None:
        self.inv_freq = _inv_freq(self.config.dim // self.config.num_heads, self.config.rope_theta).to(
            self.inv_freq.device)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        if any(t != 1 or h % cfg.merge_size or w % cfg.merge_size for t, h, w in grids):
            raise ValueError(f"image_grid_thw {grids}: each image must be one frame (t=1, videos are not taken "
                             f"yet) with h and w multiples of merge_size={cfg.merge_size}")
        lengths = [h * w for _, h, w in grids]
        want = (sum(lengths), 3, cfg.patch_size, cfg.patch_size)
        if pixel_values.shape != want and pixel_values.shape != (want[0], 3 * cfg.patch_size**2):
            raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}; image_grid_thw {grids} needs "
                             f"{list(want)} (patches x channels x patch x patch)")
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype).view(want)).flatten(1)
        rows, cols = _raster_coords(grids, x.device)
        x = x + self._position_table(grids, rows, cols).to(x.dtype)
        # channel pair 2j rotates by column * f_j, pair 2j + 1 by row * f_j, as the checkpoint pairs them
        angles = torch.stack((cols[:, None].float() * self.inv_freq, rows[:, None].float() * self.inv_freq), -1)
        rope = (angles.flatten(1).cos(), angles.flatten(1).sin())
        for block in self.blocks:
            x = block(x, rope, lengths)
        return self.projector(_merge_order(self.norm(x), grids, cfg.merge_size))

    def _position_table(self, grids: list[tuple[int, int, int]], rows: torch.Tensor, cols: torch.Tensor
                        ) -> torch.Tensor:
        """The learned table resampled bicubically (half-pixel centres, edges clamped) to each h x w grid."""
        side = self.config.pos_emb_size
        heights = torch.cat([torch.full((h * w,), h) for _, h, w in grids]).to(rows.device)
        widths = torch.cat([torch.full((h * w,), w) for _, h, w in grids]).to(rows.device)
        r_taps, r_weights = _bicubic_taps(rows, heights, side)
        c_taps, c_weights = _bicubic_taps(cols, widths, side)
        index = (r_taps[:, :, None] * side + c_taps[:, None, :]).flatten(1)
        weights = (r_weights[:, :, None] * c_weights[:, None, :]).flatten(1)
        table = self.pos_embed.flatten(0, 1)
        return (table[index] * weights[:, :, None].to(table.dtype)).sum(1)


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # one frequency per (column, row) pair of pairs: head_dim / 4 of them
    return 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device="cpu") / (head_dim // 2))


def _raster_coords(grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [torch.arange(h, device=device).repeat_interleave(w) for _, h, w in grids]
    cols = [torch.arange(w, device=device).repeat(h) for _, h, w in grids]
    return torch.cat(rows), torch.cat(cols)


def _merge_order(x: torch.Tensor, grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """Raster-order patches -> [merged tokens, merge * merge, dim], each block's patches row by row."""
    out = []
    for part, (_, h, w) in zip(x.split([h * w for _, h, w in grids]), grids):
        blocks = part.view(h // merge, merge, w // merge, merge, -1).transpose(1, 2)
        out.append(blocks.reshape((h // merge) * (w // merge), merge * merge, -1))
    return torch.cat(out)


def _bicubic_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The four table rows (and their Keys a=-0.75 weights) that target index among `size` samples reads,
    half-pixel centres (align_corners=False), out-of-range taps clamped to the edge: F.interpolate's bicubic."""
    src = (index.float() + 0.5) * side / size.float() - 0.5
    floor = torch.floor(src)
    offsets = torch.arange(-1, 3, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    d = (src[:, None] - floor[:, None] - offsets).abs()
    a = -0.75
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return taps, torch.where(d <= 1, near, far)

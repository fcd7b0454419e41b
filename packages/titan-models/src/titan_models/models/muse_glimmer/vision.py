"""Muse Glimmer's vision tower, adapter and projection: a bias-free linear patch embedding, a learned
side x side position table resampled bilinearly (half-pixel centres, zero outside) to each image's grid,
a pre-norm, blocks with windowed attention (windows of side x side patches) and, every fourth block and
the last, full attention within each image; 2-D rotary positions from 1; a post-norm, merge x merge
patches folded into the channels (channel-major), then adapter (Linear, GELU, Linear, GELU), projection
to the text width and a scaleless RMSNorm.

Input is what transformers' Muse Glimmer image processor makes: `pixel_values` [patches, patch_temporal * 3
* patch * patch], each image's patches in raster order, and `grid_thw` [images, 3] in patches (t = 1).
`MuseGlimmerConfig.vision` builds it as the model's `visual` (`tower(pixel_values, grid_thw) -> image tokens`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, frozen=True)
class MuseVisionConfig:
    depth: int
    dim: int
    ffn_dim: int
    num_heads: int
    adapter_dim: int  # projector_hidden_size
    out_dim: int  # the text model's width
    patch_size: int = 14
    patch_temporal: int = 2
    pos_emb_size: int = 32  # the table's side, also the attention window's side in patches
    merge_size: int = 2
    full_attention_layers: tuple[int, ...] | None = None  # None: every fourth block and the last
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    text_norm_eps: float = 1e-5  # the scaleless RMSNorm after the projection

    def __post_init__(self) -> None:
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 4:
            raise ValueError(f"MuseVisionConfig: dim={self.dim} must split into num_heads={self.num_heads} heads "
                             "whose width is a multiple of 4 (two rotary axes of cos/sin pairs)")

    def resolved_full_attention_layers(self) -> tuple[int, ...]:
        if self.full_attention_layers is not None:
            return self.full_attention_layers
        return tuple(i for i in range(self.depth) if (i + 1) % 4 == 0 or i == self.depth - 1)

    @property
    def patch_dim(self) -> int:
        return self.patch_temporal * 3 * self.patch_size**2

    def build(self) -> "MuseVisionTower":
        return MuseVisionTower(self)


class MuseVisionAttention(nn.Module):
    def __init__(self, config: MuseVisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.wq = nn.Linear(config.dim, config.dim)
        self.wk = nn.Linear(config.dim, config.dim)
        self.wv = nn.Linear(config.dim, config.dim)
        self.wo = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (proj(x).reshape(n, self.num_heads, -1) for proj in (self.wq, self.wk, self.wv))
        q, k = _rotate_half(q, *rope), _rotate_half(k, *rope)
        out = [F.scaled_dot_product_attention(qi.transpose(0, 1)[None], ki.transpose(0, 1)[None],
                                              vi.transpose(0, 1)[None])[0].transpose(0, 1)
               for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        return self.wo(torch.cat(out).reshape(n, -1))


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class MuseVisionBlock(nn.Module):
    def __init__(self, config: MuseVisionConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.dim, eps=1e-5)
        self.attention = MuseVisionAttention(config)
        self.ffn_norm = nn.LayerNorm(config.dim, eps=1e-5)
        self.w1 = nn.Linear(config.dim, config.ffn_dim)
        self.w2 = nn.Linear(config.ffn_dim, config.dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, lengths)
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


class MuseVisionTower(nn.Module):
    """`tower(pixel_values, grid_thw) -> image tokens [sum of h * w / merge**2, out_dim]`, images in order."""

    def __init__(self, config: MuseVisionConfig):
        super().__init__()
        self.config = config
        merged = config.dim * config.merge_size**2
        self.patch_embed = nn.Linear(config.patch_dim, config.dim, bias=False)
        self.pos_embed = nn.Embedding(config.pos_emb_size**2, config.dim)
        self.pre_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.blocks = nn.ModuleList([MuseVisionBlock(config) for _ in range(config.depth)])
        self.post_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.adapter_w1 = nn.Linear(merged, config.adapter_dim, bias=False)
        self.adapter_w2 = nn.Linear(config.adapter_dim, config.adapter_dim, bias=False)
        self.projection = nn.Linear(config.adapter_dim, config.out_dim, bias=False)
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
            raise ValueError(f"image_grid_thw {grids}: each image must be one frame (t=1) with h and w multiples "
                             f"of merge_size={cfg.merge_size}")
        if pixel_values.shape != (sum(h * w for _, h, w in grids), cfg.patch_dim):
            raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}; image_grid_thw {grids} needs "
                             f"[{sum(h * w for _, h, w in grids)}, {cfg.patch_dim}]")
        rows, cols = _raster_coords(grids, pixel_values.device)
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        x = self.pre_norm(x + self._position_table(grids, rows, cols).to(x.dtype))
        order, window_lengths = _window_order(grids, cfg.pos_emb_size, x.device)
        x, rows, cols = x[order], rows[order], cols[order]
        # first half of each head by (column + 1), second by (row + 1): the reference counts from 1
        freqs = torch.cat(((cols + 1)[:, None].float() * self.inv_freq, (rows + 1)[:, None].float() * self.inv_freq), -1)
        angles = torch.cat((freqs, freqs), dim=-1)
        rope = (angles.cos(), angles.sin())
        full = cfg.resolved_full_attention_layers()
        # full attention stays within each image: the window order keeps images contiguous
        image_lengths = [h * w for _, h, w in grids]
        for i, block in enumerate(self.blocks):
            x = block(x, rope, image_lengths if i in full else window_lengths)
        x = self.post_norm(x[torch.argsort(order)])
        x = _fold_merge_blocks(x, grids, cfg.merge_size)
        x = self.projection(F.gelu(self.adapter_w2(F.gelu(self.adapter_w1(x)))))
        return F.rms_norm(x, (x.shape[-1],), eps=cfg.text_norm_eps)

    def _position_table(self, grids: list[tuple[int, int, int]], rows: torch.Tensor, cols: torch.Tensor
                        ) -> torch.Tensor:
        side = self.config.pos_emb_size
        heights = torch.cat([torch.full((h * w,), h) for _, h, w in grids]).to(rows.device)
        widths = torch.cat([torch.full((h * w,), w) for _, h, w in grids]).to(rows.device)
        r_taps, r_weights = _bilinear_taps(rows, heights, side)
        c_taps, c_weights = _bilinear_taps(cols, widths, side)
        index = (r_taps[:, :, None] * side + c_taps[:, None, :]).flatten(1)
        weights = (r_weights[:, :, None] * c_weights[:, None, :]).flatten(1)
        return (self.pos_embed(index) * weights[:, :, None].to(self.pos_embed.weight.dtype)).sum(1)


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device="cpu") / (head_dim // 2))


def _raster_coords(grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [torch.arange(h, device=device).repeat_interleave(w) for _, h, w in grids]
    cols = [torch.arange(w, device=device).repeat(h) for _, h, w in grids]
    return torch.cat(rows), torch.cat(cols)


def _window_order(grids: list[tuple[int, int, int]], side: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Raster patches -> window order (side x side windows row by row, each window's patches row by row),
    with the (nonempty) window lengths."""
    order, lengths, offset = [], [], 0
    for _, h, w in grids:
        index = torch.arange(h * w, device=device).view(h, w)
        for r in range(0, h, side):
            for c in range(0, w, side):
                window = index[r:r + side, c:c + side].flatten()
                order.append(window + offset)
                lengths.append(window.numel())
        offset += h * w
    return torch.cat(order), lengths


def _fold_merge_blocks(x: torch.Tensor, grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """merge x merge blocks (row by row) folded channel-major: out[:, d * merge**2 + k] = patch k's channel d."""
    out = []
    for part, (_, h, w) in zip(x.split([h * w for _, h, w in grids]), grids):
        blocks = part.view(h // merge, merge, w // merge, merge, -1).transpose(1, 2).reshape(-1, merge * merge, part.shape[-1])
        out.append(blocks.transpose(1, 2).flatten(1))
    return torch.cat(out)


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table rows (and weights) target index among `size` samples reads, half-pixel centres, taps
    outside the table weighted zero (F.grid_sample's padding_mode="zeros")."""
    src = (index.float() + 0.5) * side / size.float() - 0.5
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    raw = floor.long()[:, None] + offsets
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0) * ((raw >= 0) & (raw < side))
    return raw.clamp(0, side - 1), weights

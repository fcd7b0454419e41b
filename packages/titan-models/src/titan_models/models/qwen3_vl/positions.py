"""Qwen3-VL's 3-D (temporal, height, width) token positions, from the tokens and `image_grid_thw`.

Text tokens count up on all three axes. An image's merged tokens (its grid in patches divided by the
spatial merge) sit at (start + frame, start + row, start + column), `start` being the position after the
text before it; the text after it resumes at start + max(rows, columns). Images are taken from
`image_grid_thw` in order: the first sample's images, then the second's, and so on.
"""
from __future__ import annotations

import torch


def image_token_counts(image_grid_thw: torch.Tensor, spatial_merge_size: int) -> list[int]:
    """Merged tokens per image: t * h * w / merge^2."""
    return [int(t) * int(h) * int(w) // spatial_merge_size**2 for t, h, w in image_grid_thw.tolist()]


def mrope_positions(tokens: torch.Tensor, image_grid_thw: torch.Tensor, *, image_token_id: int,
                    spatial_merge_size: int, start: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [3, b, s], next_position [b]): the 3-D positions of `tokens` [b, s] and the position
    the next text token of each sample takes (decoding continues there on all three axes).

    `start` [b] offsets each sample (a continuation after a prefix). ValueError, naming the sample,
    when a sample has more image tokens than images left, or a run of image tokens that is not whole
    images; and when images are left over after the last sample.
    """
    counts = image_token_counts(image_grid_thw, spatial_merge_size)
    grids = [(int(t), int(h) // spatial_merge_size, int(w) // spatial_merge_size)
             for t, h, w in image_grid_thw.tolist()]
    batch, seq = tokens.shape
    positions = torch.empty(3, batch, seq, dtype=torch.long)
    next_position = torch.empty(batch, dtype=torch.long)
    image = 0
    for b, row in enumerate((tokens == image_token_id).cpu().tolist()):
        pos = 0 if start is None else int(start[b])
        i = 0
        while i < seq:
            if not row[i]:
                positions[:, b, i] = pos
                pos, i = pos + 1, i + 1
                continue
            run_end = i
            while run_end < seq and row[run_end]:
                run_end += 1
            while i < run_end:  # whole images, one after another, fill the run
                if image == len(counts):
                    raise ValueError(f"sample {b} has more image tokens than images: image_grid_thw lists "
                                     f"{len(counts)} images, all used before token {i} of sample {b}")
                if i + counts[image] > run_end:
                    raise ValueError(f"sample {b}: image {image} needs {counts[image]} image tokens from token {i}, "
                                     f"but the run of image tokens ends at {run_end}")
                t, h, w = grids[image]
                frame, r, c = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
                positions[:, b, i:i + counts[image]] = pos + torch.stack([frame, r, c]).reshape(3, -1)
                pos, i, image = pos + max(h, w), i + counts[image], image + 1
        next_position[b] = pos
    if image != len(counts):
        raise ValueError(f"image_grid_thw lists {len(counts)} images but the samples' image tokens hold {image}")
    return positions.to(tokens.device), next_position.to(tokens.device)

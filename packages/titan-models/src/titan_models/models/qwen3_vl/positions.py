"""Qwen3-VL's 3-D (temporal, height, width) token positions, from the tokens, `image_grid_thw` and
`video_grid_thw`.

Text tokens count up on all three axes. An image's merged tokens (its grid in patches divided by the
spatial merge) sit at (start + frame, start + row, start + column), `start` being the position after the
text before it; the text after it resumes at start + max(rows, columns). A video is taken frame by frame
(each temporal patch one grid of t = 1, as transformers splits `video_grid_thw`: the timestamps in the text
between frames order them). Images and video frames are taken from their grids in order: the first
sample's, then the second's, and so on.
"""
from __future__ import annotations

import functools

import torch


def image_token_counts(image_grid_thw: torch.Tensor, spatial_merge_size: int) -> list[int]:
    """Merged tokens per image (or video): t * h * w / merge^2."""
    return [int(t) * int(h) * int(w) // spatial_merge_size**2 for t, h, w in image_grid_thw.tolist()]


def video_frame_grids(video_grid_thw: torch.Tensor) -> torch.Tensor:
    """[videos, 3] -> [frames, 3]: each video's grid once per temporal patch, with t = 1."""
    frames = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
    frames[:, 0] = 1
    return frames


def mrope_positions(tokens: torch.Tensor, image_grid_thw: torch.Tensor | None, *, image_token_id: int,
                    spatial_merge_size: int, start: torch.Tensor | None = None,
                    video_grid_thw: torch.Tensor | None = None, video_token_id: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [3, b, s], next_position [b]): the 3-D positions of `tokens` [b, s] and the position
    the next text token of each sample takes (decoding continues there on all three axes).

    `start` [b] offsets each sample (a continuation after a prefix). ValueError, naming the sample,
    when a sample has more image (video) tokens than images (frames) left, or a run of them that is not
    whole images (frames); and when images or frames are left over after the last sample.
    """
    kinds = {image_token_id: _Visual("image", "image_grid_thw", image_grid_thw, spatial_merge_size)}
    if video_grid_thw is not None:
        assert video_token_id is not None, "video_grid_thw needs video_token_id"
        kinds[video_token_id] = _Visual("video frame", "video_grid_thw", video_frame_grids(video_grid_thw),
                                          spatial_merge_size)
    batch, seq = tokens.shape
    # Built as host lists, one tensor at the end: a tensor write per token or image made this per-row loop
    # the step's largest host cost at small images (128 rows, thousands of small writes).
    positions: list[list[list[int]]] = [[], [], []]  # [axis][sample][token]
    next_position = []
    for b, row in enumerate(tokens.cpu().tolist()):
        pos = 0 if start is None else int(start[b])
        axes: list[list[int]] = [[], [], []]
        i = 0
        while i < seq:
            kind = kinds.get(row[i])
            if kind is None:  # the text up to the next visual token
                end = i + 1
                while end < seq and row[end] not in kinds:
                    end += 1
                for axis in axes:
                    axis.extend(range(pos, pos + end - i))
                pos, i = pos + end - i, end
                continue
            run_end = i
            while run_end < seq and row[run_end] == row[i]:
                run_end += 1
            while i < run_end:  # whole images (frames), one after another, fill the run
                count, (t, h, w) = kind.take(b, i, run_end)
                for axis, offsets in zip(axes, _grid_offsets(t, h, w)):
                    axis.extend(pos + o for o in offsets)
                pos, i = pos + max(h, w), i + count
        for all_rows, axis in zip(positions, axes):
            all_rows.append(axis)
        next_position.append(pos)
    for kind in kinds.values():
        kind.check_all_used()
    return (torch.tensor(positions, dtype=torch.long).view(3, batch, seq).to(tokens.device),
            torch.tensor(next_position, dtype=torch.long).to(tokens.device))


@functools.lru_cache(maxsize=64)
def _grid_offsets(t: int, h: int, w: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(frame, row, column) of each merged token of a t x h x w grid, frame-major then row-major."""
    return (tuple(f for f in range(t) for _ in range(h * w)),
            tuple(r for _ in range(t) for r in range(h) for _ in range(w)),
            tuple(c for _ in range(t * h) for c in range(w)))


class _Visual:
    """The grids of one kind of visual input (images, or video frames), taken in order."""

    def __init__(self, name: str, source: str, grid_thw: torch.Tensor | None, merge: int):
        grid_thw = torch.zeros(0, 3, dtype=torch.long) if grid_thw is None else grid_thw
        self.name, self.source, self.counts = name, source, image_token_counts(grid_thw, merge)
        self.grids = [(int(t), int(h) // merge, int(w) // merge) for t, h, w in grid_thw.tolist()]
        self.used = 0

    def take(self, sample: int, token: int, run_end: int) -> tuple[int, tuple[int, int, int]]:
        """(token count, merged grid) of the next one, which must fit the run [token, run_end)."""
        name, k = self.name, self.used
        if k == len(self.counts):
            raise ValueError(f"sample {sample} has more {name} tokens than {name}s: {self.source} lists "
                             f"{len(self.counts)} {name}s, all used before token {token} of sample {sample}")
        if token + self.counts[k] > run_end:
            raise ValueError(f"sample {sample}: {name} {k} needs {self.counts[k]} {name} tokens from token {token}, "
                             f"but the run of {name} tokens ends at {run_end}")
        self.used += 1
        return self.counts[k], self.grids[k]

    def check_all_used(self) -> None:
        if self.used != len(self.counts):
            raise ValueError(f"{self.source} lists {len(self.counts)} {self.name}s but the samples' {self.name} tokens "
                             f"hold {self.used}")

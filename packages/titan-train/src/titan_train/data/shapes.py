"""A synthetic image-text task needing no download: coloured shapes drawn at run time, with captions.

Each sample is one 64x64 image of a shape (circle, square or triangle, of one of four colours, at a random
place and size on a grey background) followed by its caption ("a red circle"). A family whose processor pads
instead of resizing (Kimi K2.x: to multiples of patch * merge = 28 pixels) gets the largest side it takes
unpadded, 56: 4 x 4 patches, 4 image tokens, as Qwen3-VL's 64x64 at 16-pixel patches. Padded to 84 x 84
(6 x 6 patches, 42% of the pixels padding, the shape on a few patches), the debug Kimi's trained tower
came to give every image the same tokens and the model never read them; drawn 84 x 84 unpadded, the same.
A row is `[image tokens] caption EOS` right-padded: loss on the caption's tokens only (image and padding
positions are IGNORE_INDEX), so the loss falls only as the model learns to read the image. Samples depend
only on (seed, index): the loader's position is one integer.
"""
from __future__ import annotations

import torch

from .image_inputs import image_inputs
from .loader import IGNORE_INDEX, Batch
from .tokenizer import ByteTokenizer

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 70, 230), "yellow": (230, 210, 30)}
SIZE = 64


def draw_shape(shape: str, colour: tuple[int, int, int], gen: torch.Generator, size: int = SIZE) -> torch.Tensor:
    """uint8 [size, size, 3]: the shape filled in `colour`, centred at a random point, radius 12-20 pixels."""
    radius = int(torch.randint(12, 21, (), generator=gen))
    cy, cx = (int(v) for v in torch.randint(radius, size - radius, (2,), generator=gen))
    y, x = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    dy, dx = y - cy, x - cx
    if shape == "circle":
        inside = dy**2 + dx**2 <= radius**2
    elif shape == "square":
        inside = (dy.abs() <= radius * 0.8) & (dx.abs() <= radius * 0.8)
    else:  # an upward triangle: below the apex, inside both slanted edges
        inside = (dy >= -radius) & (dy <= radius * 0.6) & (dx.abs() <= (dy + radius) * 0.6)
    image = torch.full((size, size, 3), 128, dtype=torch.uint8)
    image[inside] = torch.tensor(colour, dtype=torch.uint8)
    return image


def canvas_side(preprocess) -> int:
    """SIZE, or for a processor that pads to whole merge blocks (its target_size gives (resized, padded)
    sizes: Kimi K2.x) the largest multiple of patch * merge within SIZE, so that no patch is padding."""
    sizes = preprocess.target_size(SIZE, SIZE)
    if isinstance(sizes[0], tuple) and sizes[0] != sizes[1]:
        block = preprocess.patch_size * preprocess.merge_size
        return SIZE // block * block
    return SIZE


class ShapesLoader:
    """Rows of the shapes task for a vision-language model config (qwen3_vl, kimi_k25, muse_glimmer with a
    tower: image_inputs.py); `next_batch(rows)` -> Batch with `images`."""

    def __init__(self, model_config, tokenizer: ByteTokenizer, *, seq_len: int, seed: int = 0):
        self.inputs = image_inputs(model_config, needed_by="data.source=shapes")
        self.tokenizer, self.seq_len, self.seed = tokenizer, seq_len, seed
        self.position = 0
        self.side = canvas_side(self.inputs.preprocess)
        # every image is side x side: one grid, so one token count, for all samples
        grid = self.inputs.preprocess.from_pixels(torch.zeros(self.side, self.side, 3, dtype=torch.uint8))[1][0]
        self.prefix = self.inputs.tokens(grid)
        longest = len(self.prefix) + len("a yellow triangle") + 1
        if seq_len + 1 < longest:
            raise ValueError(f"training.seq_len={seq_len} is too short for the shapes task: a sample takes "
                             f"{longest - 1} positions")

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])

    def _sample(self, index: int) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor], int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        shape = SHAPES[int(torch.randint(len(SHAPES), (), generator=gen))]
        colour = list(COLOURS)[int(torch.randint(len(COLOURS), (), generator=gen))]
        image = self.inputs.preprocess.from_pixels(draw_shape(shape, COLOURS[colour], gen, self.side))
        caption = self.tokenizer.encode(f"a {colour} {shape}").tolist() + [self.tokenizer.eos_id]
        return self.prefix + caption, image, len(self.prefix)

    def next_batch(self, rows: int) -> Batch:
        tokens = torch.full((rows, self.seq_len + 1), self.tokenizer.pad_id, dtype=torch.long)
        scored = torch.zeros(rows, self.seq_len + 1, dtype=torch.bool)
        images = []
        for r in range(rows):
            seq, image, prefix = self._sample(self.position)
            self.position += 1
            tokens[r, :len(seq)] = torch.tensor(seq)
            scored[r, prefix:len(seq)] = True  # the caption and its EOS
            images.append(image)
        labels = tokens[:, 1:].masked_fill(~scored[:, 1:], IGNORE_INDEX)
        return Batch(tokens[:, :-1].contiguous(), labels, None, images=images)

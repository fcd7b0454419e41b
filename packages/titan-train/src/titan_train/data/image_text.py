"""Image-text records (jsonl lines, or a Hugging Face dataset saved with save_to_disk) as rows for a
vision-language model.

A record holds its text (`data.text_field`) and its images (`data.image_field`): a list of image paths
(relative to the folder of `data.source`, or absolute), or, in a saved dataset's Image column, the
`{"bytes", "path"}` structs `datasets` writes. Each `<image>` placeholder in the text (`data.image_placeholder`)
becomes that image's tokens in place (per family, image_inputs.py: e.g. vision start, one image token per
merged patch, vision end), pixels from the family's titan-models preprocessing (qwen3_vl, kimi_k25,
muse_glimmer); a text
with no placeholder gets its images before it. One record per row, right-padded: an image's tokens cannot
be split over two rows, and the model's multimodal positions start from each row's first token. Loss on the
text tokens only (image tokens, vision markers and padding are IGNORE_INDEX).

A missing image file, an unreadable image, a placeholder count that differs from the images, or a record
longer than a row raise ValueError naming the record, when the loader reaches it.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .image_inputs import QWEN_PIXELS, image_inputs
from .loader import IGNORE_INDEX, Batch


def _open_image(item: Any, root: Path, where: str):
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, dict):  # a saved dataset's Image column: {"bytes": ..., "path": ...}
        data, path = item.get("bytes"), item.get("path")
        source = io.BytesIO(data) if data else (root / path if path else None)
    elif isinstance(item, str):
        source = Path(item) if Path(item).is_absolute() else root / item
    else:
        raise ValueError(f"{where}: an image is given as {type(item).__name__}; "
                         "give a path or a {bytes, path} struct")
    if source is None:
        raise ValueError(f"{where}: an image struct holds neither bytes nor a path")
    if isinstance(source, Path) and not source.is_file():
        raise ValueError(f"{where}: image file {source} does not exist")
    try:
        image = Image.open(source)
        image.load()
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{where}: image {source if isinstance(source, Path) else '(bytes)'} is unreadable "
                         f"({e})") from None
    return image


class ImageTextLoader:
    """`next_batch(rows)` -> Batch with `images` (per row: its images' pixel_values and image_grid_thw)."""

    def __init__(self, model_config: Any, tokenizer: Any, texts: Any, images: Any, *, seq_len: int, seed: int,
                 shuffle: bool, root: Path, origin: str, placeholder: str = "<image>",
                 pixels: tuple[int, int] = QWEN_PIXELS):
        self.inputs = image_inputs(model_config, needed_by="data.image_field", pixels=pixels)
        if not placeholder:
            raise ValueError("data.image_placeholder must not be empty")
        assert len(texts) == len(images)
        self.config, self.tokenizer, self.texts, self.images = model_config, tokenizer, texts, images
        self.seq_len, self.seed, self.shuffle, self.root, self.origin = seq_len, seed, shuffle, root, origin
        self.placeholder = placeholder
        self.pad_id = getattr(tokenizer, "pad_id", tokenizer.eos_id)
        self.position = 0  # records consumed, over all epochs

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])

    def _record_index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.texts))
        if not self.shuffle:
            return offset
        order = np.random.default_rng(self.seed * 1_000_003 + epoch).permutation(len(self.texts))
        return int(order[offset])

    def _sample(self, index: int) -> tuple[list[int], list[bool], tuple[torch.Tensor, torch.Tensor] | None]:
        """(tokens, scored per token, the record's (pixel_values, image_grid_thw) or None)."""
        where = f"{self.origin}: record {index + 1}"
        text, items = self.texts[index], self.images[index] or []
        if not isinstance(items, list):
            items = [items]
        pieces = text.split(self.placeholder)
        if len(pieces) == 1 and items:
            pieces = [""] * len(items) + [text]  # no placeholder: the images come first
        if len(pieces) - 1 != len(items):
            raise ValueError(f"{where} has {len(pieces) - 1} {self.placeholder!r} placeholder(s) but "
                             f"{len(items)} image(s)")
        pixels, grids = [], []
        if items:
            pixels, grids = self.inputs.preprocess([_open_image(item, self.root, where) for item in items])
        tokens, scored = [], []
        for i, piece in enumerate(pieces):
            if piece:
                ids = self.tokenizer.encode(piece).tolist()
                tokens += ids
                scored += [True] * len(ids)
            if i < len(items):
                image = self.inputs.tokens(grids[i])
                tokens += image
                scored += [False] * len(image)
        tokens.append(self.tokenizer.eos_id)
        scored.append(True)
        if len(tokens) > self.seq_len + 1:
            raise ValueError(f"{where} takes {len(tokens) - 1} positions, more than training.seq_len="
                             f"{self.seq_len} (a record is not split over rows: raise seq_len or shrink its images)")
        return tokens, scored, ((pixels, grids) if items else None)

    def next_batch(self, rows: int) -> Batch:
        tokens = torch.full((rows, self.seq_len + 1), self.pad_id, dtype=torch.long)
        scored = torch.zeros(rows, self.seq_len + 1, dtype=torch.bool)
        images = []
        for r in range(rows):
            seq, mask, image = self._sample(self._record_index(self.position))
            self.position += 1
            tokens[r, :len(seq)] = torch.tensor(seq)
            scored[r, :len(seq)] = torch.tensor(mask)
            images.append(image if image is not None else self.inputs.empty())
        # label t is token t+1: scored where the predicted token is text (or the EOS)
        labels = tokens[:, 1:].masked_fill(~scored[:, 1:], IGNORE_INDEX)
        return Batch(tokens[:, :-1].contiguous(), labels, None, images=images)


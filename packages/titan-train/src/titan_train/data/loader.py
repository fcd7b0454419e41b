"""Sequence packing with document ids, and a loader whose position is a checkpointable handful of ints.

Documents (each followed by the tokenizer's EOS) form one token stream in a seeded per-epoch order;
rows are consecutive windows of seq_len + 1 tokens that overlap by one, so every token is a label once.
Every rank reads the same global stream and keeps its own rows: the loss curve does not depend on
the data-parallel degree, and the loader state is the same on every rank.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .sources import Documents
from .tokenizer import Tokenizer

IGNORE_INDEX = -100

# A document -> (its tokens, which of them are scored as labels). Plain text: every token plus the EOS
# appended; chat data (chat.py): the assistant's tokens only.
Encode = Callable[[bytes | str], tuple[np.ndarray, np.ndarray]]


@dataclass
class Batch:
    tokens: torch.Tensor  # [rows, seq] int64
    labels: torch.Tensor  # [rows, seq] int64, IGNORE_INDEX where the next token is another document's
    document_ids: torch.Tensor | None  # [rows, seq] int64: which packed document each position belongs to
    # image-text data: per row, (pixel_values, image_grid_thw) of the images whose tokens the row holds
    images: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def rows(self, start: int, stop: int) -> Batch:
        ids = None if self.document_ids is None else self.document_ids[start:stop]
        images = None if self.images is None else self.images[start:stop]
        return Batch(self.tokens[start:stop], self.labels[start:stop], ids, images)

    def to(self, device: torch.device) -> Batch:
        ids = None if self.document_ids is None else self.document_ids.to(device, non_blocking=True)
        images = None if self.images is None else _images_to(self.images, device)
        return Batch(self.tokens.to(device, non_blocking=True), self.labels.to(device, non_blocking=True), ids, images)

    def image_inputs(self) -> dict[str, torch.Tensor]:
        """The model's pixel_values / image_grid_thw for these rows (empty without images)."""
        if not self.images or not any(len(g) for _, g in self.images):  # no row here holds an image
            return {}
        return {"pixel_values": torch.cat([p for p, _ in self.images]),
                "image_grid_thw": torch.cat([g for _, g in self.images])}


def _images_to(images: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every row's (pixel_values, image_grid_thw) on `device` in one copy of each (a copy per row and
    tensor was 256 small copies for the shapes task's 128 rows), split back into each row's views."""
    kinds = {(p.dtype, p.shape[1:], g.dtype, g.shape[1:]) for p, g in images}
    if len(kinds) != 1:  # none, or rows that cat would not join as they are (other dtypes or widths)
        return [(p.to(device), g.to(device)) for p, g in images]
    pixels = torch.cat([p for p, _ in images]).to(device).split([len(p) for p, _ in images])
    grids = torch.cat([g for _, g in images]).to(device).split([len(g) for _, g in images])
    return list(zip(pixels, grids))


class PackedLoader:
    def __init__(self, documents: Documents, tokenizer: Tokenizer, *, seq_len: int, seed: int = 0,
                 shuffle: bool = True, document_masking: bool = True, encode: Encode | None = None):
        if len(documents) == 0:
            raise ValueError("the data source holds no documents")
        if seq_len < 1:
            raise ValueError(f"training.seq_len must be >= 1, got {seq_len}")
        if encode is None:  # chat records are checked by their encoder (chat.py)
            _check_has_tokens(documents, tokenizer)
        self.documents, self.tokenizer = documents, tokenizer
        self.seq_len, self.seed, self.shuffle, self.document_masking = seq_len, seed, shuffle, document_masking
        self.encode = encode or self._encode_text
        self.epoch = self.position = self.offset = 0  # the stream's cursor: document `position` of `epoch`'s order
        self._order: torch.Tensor | None = None
        self._doc: tuple[np.ndarray, np.ndarray] | None = None

    # --- position -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        # The stream's size and vocabulary are saved with the cursor: the cursor means nothing in another one.
        return {"epoch": self.epoch, "position": self.position, "offset": self.offset,
                "documents": len(self.documents), "vocab_size": self.tokenizer.vocab_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved = (int(state["documents"]), int(state["vocab_size"]))
        if saved != (len(self.documents), self.tokenizer.vocab_size):
            raise ValueError(
                f"the checkpoint was written reading {saved[0]} documents with a {saved[1]}-token vocabulary, but "
                f"data.source and data.tokenizer now give {len(self.documents)} documents and "
                f"{self.tokenizer.vocab_size} tokens; resume with the data the run started with, or start a "
                "new run in another job.folder")
        self.epoch, self.position, self.offset = int(state["epoch"]), int(state["position"]), int(state["offset"])
        self._order = self._doc = None

    # --- the token stream ---------------------------------------------------------------------------
    def _encode_text(self, document: bytes | str) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.append(self.tokenizer.encode(document), self.tokenizer.eos_id)
        return tokens, np.ones(len(tokens), dtype=bool)

    def _document(self) -> tuple[np.ndarray, np.ndarray]:
        if self._doc is None:
            if self._order is None:
                if self.shuffle:
                    g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                    self._order = torch.randperm(len(self.documents), generator=g)
                else:
                    self._order = torch.arange(len(self.documents))
            self._doc = self.encode(self.documents[int(self._order[self.position])])
            if self.offset >= len(self._doc[0]):  # only a cursor from another stream gets here
                raise ValueError(f"the data position (epoch {self.epoch}, document {self.position}, token "
                                 f"{self.offset}) lies past that document's {len(self._doc[0])} tokens: the "
                                 "checkpoint was written reading other data")
        return self._doc

    def _advance_document(self) -> None:
        self.position, self.offset, self._doc = self.position + 1, 0, None
        if self.position == len(self.documents):
            self.epoch, self.position, self._order = self.epoch + 1, 0, None

    def row(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """seq_len + 1 tokens, their document numbers and scored flags; the cursor moves by seq_len (one
        overlaps)."""
        tokens = np.empty(self.seq_len + 1, dtype=np.int64)
        doc_ids = np.empty(self.seq_len + 1, dtype=np.int64)
        scored = np.empty(self.seq_len + 1, dtype=bool)
        filled, doc_number = 0, 0
        while filled < self.seq_len + 1:
            doc, doc_scored = self._document()
            take = min(self.seq_len + 1 - filled, len(doc) - self.offset)
            tokens[filled:filled + take] = doc[self.offset:self.offset + take]
            scored[filled:filled + take] = doc_scored[self.offset:self.offset + take]
            doc_ids[filled:filled + take] = doc_number
            filled += take
            if filled == self.seq_len + 1:
                # The last token is also the next row's first: leave the cursor on it.
                self.offset += take - 1
            else:
                self.offset += take
            if self.offset == len(doc):
                self._advance_document()
                doc_number += 1
        return tokens, doc_ids, scored

    def next_batch(self, rows: int) -> Batch:
        """The next `rows` packed sequences of the stream."""
        return pack_rows([self.row() for _ in range(rows)], document_masking=self.document_masking)


def pack_rows(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]], *, document_masking: bool) -> Batch:
    """Rows of (seq + 1 tokens, document numbers, scored flags) -> a Batch: labels are the next tokens,
    IGNORE_INDEX where the next token is not scored or (document_masking) belongs to another document."""
    tokens, doc_ids, scored = (np.stack(parts) for parts in zip(*rows))  # [rows, seq + 1] each
    labels = tokens[:, 1:].copy()
    labels[~scored[:, 1:]] = IGNORE_INDEX
    if document_masking:
        labels[doc_ids[:, 1:] != doc_ids[:, :-1]] = IGNORE_INDEX
    ids = torch.from_numpy(doc_ids[:, :-1].copy()) if document_masking else None
    return Batch(torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(labels), ids)


_PROBED_DOCUMENTS = 1000


def _check_has_tokens(documents: Documents, tokenizer: Tokenizer) -> None:
    """ValueError when the first documents (up to 1000, the whole corpus when it is that small) all
    tokenize to nothing: the run would train on end-of-document tokens alone (its loss 0 under document
    masking)."""
    probed = min(len(documents), _PROBED_DOCUMENTS)
    for i in range(probed):
        if len(tokenizer.encode(documents[i])):
            return
    whole = "all" if probed == len(documents) else "the first"
    raise ValueError(f"the data source holds no tokens to train on: {whole} {probed} documents are empty "
                     f"(of {len(documents)}); check data.source and data.text_field")

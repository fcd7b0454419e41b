"""Tokenizers: the built-in byte-level one, and Hugging Face `tokenizer.json` files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, document: bytes | str) -> np.ndarray: ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Token = byte (0..255), then BOS 256, EOS 257, PAD 258: any text, no files, no training."""

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, document: bytes | str) -> np.ndarray:
        data = document.encode("utf-8") if isinstance(document, str) else document
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# The end-of-document token of the usual tokenizer families, tried in order when tokenizer_config.json
# does not name one.
_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>", "<｜end▁of▁sentence｜>")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (through the `tokenizers` library); documents end with its EOS."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"data.tokenizer: {str(path)!r} is neither 'byte' nor a tokenizer.json file or folder")
        try:
            self._tok = _Tokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
            raise ValueError(f"data.tokenizer: {file} is not a valid tokenizer.json ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(file.parent)

    def _find_eos(self, folder: Path) -> int:
        names = list(_EOS_CANDIDATES)
        config = folder / "tokenizer_config.json"
        if config.is_file():
            try:
                eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            except (ValueError, AttributeError) as e:
                raise ValueError(f"data.tokenizer: {config} is not a JSON object ({e})") from None
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.insert(0, eos)
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        raise ValueError(f"tokenizer {folder}: no end-of-document token found (tried {', '.join(names)})")

    def encode(self, document: bytes | str) -> np.ndarray:
        text = document.decode("utf-8", errors="replace") if isinstance(document, bytes) else document
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def build_tokenizer(spec: str) -> Tokenizer:
    """`byte` or the path of a tokenizer.json (or a folder holding one)."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)

"""Character tokenizers for the synthetic tasks (no download, no vocabulary file)."""
from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255, then BOS (256), EOS (257), PAD (258): fits any model with vocab >= 259."""

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class CharTokenizer:
    """One id per character of `alphabet`, then EOS and PAD: a tiny vocabulary for tiny models."""

    def __init__(self, alphabet: str) -> None:
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise ValueError(f"alphabet must be non-empty without repeated characters; got {alphabet!r}")
        self.alphabet = alphabet
        self._ids = {c: i for i, c in enumerate(alphabet)}
        self.eos_id, self.pad_id = len(alphabet), len(alphabet) + 1
        self.vocab_size = len(alphabet) + 2

    def encode(self, text: str) -> list[int]:
        missing = sorted(set(text) - set(self._ids))
        if missing:
            raise ValueError(f"characters {missing} are not in the tokenizer's alphabet {self.alphabet!r}")
        return [self._ids[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i] for i in ids if i < len(self.alphabet))

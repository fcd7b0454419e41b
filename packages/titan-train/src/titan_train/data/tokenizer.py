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


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in character for each byte (what the `tokenizers` ByteLevel steps use):
    printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


class ByteTokenizer:
    """Token = byte (0..255), then BOS 256, EOS 257, PAD 258: any text, no files, no training."""

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259
    special_tokens = ("<|bos|>", "<|eos|>", "<|pad|>")

    def save_hf(self, folder: Path, *, chat_template: bool = False) -> None:
        """tokenizer.json + tokenizer_config.json giving the same ids through transformers' fast tokenizer
        (a byte-level BPE without merges); with chat_template, the built-in chat template too."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as _Tokenizer

        vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
        tokenizer = _Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([AddedToken(t, special=True) for t in self.special_tokens])
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(folder / "tokenizer.json"))
        bos, eos, pad = self.special_tokens
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": pad,
                  "model_max_length": 1 << 30}
        if chat_template:
            from .chat import BUILTIN_TEMPLATE

            config["chat_template"] = BUILTIN_TEMPLATE
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    def encode(self, document: bytes | str) -> np.ndarray:
        data = document.encode("utf-8") if isinstance(document, str) else document
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """The tokens of `text` and the index of the character each one starts in."""
        tokens = self.encode(text)
        widths = [len(char.encode("utf-8")) for char in text]
        return tokens, np.repeat(np.arange(len(text), dtype=np.int64), widths)


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

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """The tokens of `text` (special tokens in it recognised) and the character each one starts at."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
        return np.asarray(encoding.ids, dtype=np.int64), starts


def build_tokenizer(spec: str) -> Tokenizer:
    """`byte` or the path of a tokenizer.json (or a folder holding one)."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)

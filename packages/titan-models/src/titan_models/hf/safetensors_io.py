"""Reading and writing Hugging Face safetensors folders (one file, or shards with an index)."""
from __future__ import annotations

import ctypes
import json
import struct
import sys
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsFolder:
    """Lazy access to the tensors of a folder: names and shapes without reading data."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.folder / file for name, file in weight_map.items()}
        elif (self.folder / SINGLE_FILE).exists():
            with safe_open(self.folder / SINGLE_FILE, framework="pt") as f:
                self._file_of = {name: self.folder / SINGLE_FILE for name in f.keys()}
        else:
            raise ValueError(f"{self.folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._handles: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self._file_of)

    def _handle(self, name: str):
        path = self._file_of[name]
        if path not in self._handles:
            if not path.exists():
                raise ValueError(f"{INDEX_FILE} maps {name!r} to {path.name}, which does not exist")
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)


def write_safetensors(folder: Path, entries: Iterable[tuple[str, tuple[int, ...], torch.dtype,
                                                       Callable[[], torch.Tensor]]],
                      *, max_shard_bytes: int) -> None:
    """Write (name, shape, dtype, make_tensor) entries, sharded once the total exceeds max_shard_bytes.

    Shards are planned from shapes first and each tensor is materialised only while it is written,
    so peak memory is one tensor.
    """
    shards: list[list] = [[]]
    shard_bytes = 0
    total = 0
    for entry in entries:
        _, shape, dtype, _ = entry
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += nbytes
        total += nbytes
    if len(shards) == 1:
        _write_file(folder / SINGLE_FILE, shards[0])
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_file(folder / file, shard)
        weight_map |= {name: file for name, _, _, _ in shard}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def _write_file(path: Path, entries: list) -> None:
    """The safetensors layout (an 8-byte little-endian header size, a JSON header with each tensor's
    dtype, shape and byte range, then the raw bytes), streamed one tensor at a time.

    Written here rather than with safetensors.torch.save_file, which needs the whole shard in
    memory at once and numpy (not a dependency of this package).
    """
    assert sys.byteorder == "little", "safetensors stores little-endian data"
    header: dict = {"__metadata__": {"format": "pt"}}  # transformers requires the format tag
    offset = 0
    for name, shape, dtype, _ in entries:
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {dtype} cannot be stored in safetensors")
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # pad so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, shape, dtype, make in entries:
            tensor = make().detach().to("cpu").contiguous()
            assert tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype, name
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes:
                f.write((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr()))

"""Reading and writing Hugging Face safetensors folders (one file, or shards with an index)."""
from __future__ import annotations

import ctypes
import json
import struct
import sys
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import SafetensorError, safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsFolder:
    """Lazy access to the tensors of a folder: names and shapes without reading data.

    Damaged folders are ValueErrors naming the file (and tensor): an index that is not JSON or has no
    `weight_map`, an empty or truncated safetensors file, a tensor missing from the file the index names,
    a floating-point tensor holding NaN or inf."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._handles: dict[Path, object] = {}
        index = self.folder / INDEX_FILE
        if index.exists():
            self._file_of = {name: self.folder / file for name, file in _read_weight_map(index).items()}
        elif (self.folder / SINGLE_FILE).exists():
            names = self._open(self.folder / SINGLE_FILE).keys()
            self._file_of = {name: self.folder / SINGLE_FILE for name in names}
        else:
            raise ValueError(f"{self.folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")

    def names(self) -> set[str]:
        return set(self._file_of)

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(path, framework="pt")
            except SafetensorError as e:
                size = path.stat().st_size
                raise ValueError(f"{path} is not a readable safetensors file ({size} bytes; {e}): "
                                 "empty, truncated or damaged") from None
        return self._handles[path]

    def _handle(self, name: str):
        path = self._file_of[name]
        if not path.exists():
            raise ValueError(f"{INDEX_FILE} maps {name!r} to {path.name}, which does not exist")
        handle = self._open(path)
        if name not in handle.keys():
            raise ValueError(f"{INDEX_FILE} maps {name!r} to {path.name}, which does not hold it")
        return handle

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        tensor = self._handle(name).get_tensor(name)
        if tensor.is_floating_point():
            # isfinite has no kernel for the 1-byte floats: check those as float32 (which holds them exactly)
            finite = torch.isfinite(tensor if tensor.element_size() > 1 else tensor.to(torch.float32))
            if not bool(finite.all()):
                raise ValueError(f"{self._file_of[name]}: tensor {name!r} holds {int((~finite).sum())} NaN or inf "
                                 f"values (of {tensor.numel()})")
        return tensor


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        content = json.loads(index.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{index} is not valid JSON ({e})") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index} has no 'weight_map' object (tensor name -> file name)")
    return weight_map


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

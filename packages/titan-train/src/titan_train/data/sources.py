"""Document collections: random access to raw documents (bytes or str) by index.

Random access (not a stream) is what makes the loader's position a handful of integers: a resumed
run re-opens the same collection and continues at (epoch, document, token).
"""
from __future__ import annotations

import json
import sysconfig
from bisect import bisect_right
from pathlib import Path
from typing import Protocol, Sequence


class Documents(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> bytes | str: ...


class FileDocuments:
    """One document per file (read as bytes when asked for)."""

    def __init__(self, files: Sequence[Path]):
        self.files = list(files)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> bytes:
        return self.files[index].read_bytes()


def stdlib_documents() -> FileDocuments:
    """Python's own standard-library sources: a corpus every Python installation carries (~12 MB).

    The test suites are left out: they hold deliberately odd data (undecodable bytes, huge literals)
    that makes the loss of a small model jump for a batch."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
    files = sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))
    if not files:
        raise ValueError(f"data.source=stdlib: no .py files under {root}")
    return FileDocuments(files)


class JsonlDocuments:
    """One document per line of a .jsonl file: the `text_field` of each JSON object."""

    def __init__(self, path: Path, text_field: str):
        self.path, self.text_field = path, text_field
        self._offsets = []
        with open(path, "rb") as f:
            offset = 0
            for line in f:
                if line.strip():
                    self._offsets.append(offset)
                offset += len(line)
        self._file = None

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index: int) -> str:
        if self._file is None:
            self._file = open(self.path, "rb")
        self._file.seek(self._offsets[index])
        record = json.loads(self._file.readline())
        if self.text_field not in record:
            raise ValueError(f"{self.path}: line {index} has no field {self.text_field!r} "
                             f"(data.text_field; it has {', '.join(record)})")
        return record[self.text_field]


class ArrowDocuments:
    """The string column `text_field` of an Arrow table (parquet files, saved HF datasets)."""

    def __init__(self, table, text_field: str, origin: str):
        if text_field not in table.column_names:
            raise ValueError(f"{origin}: no column {text_field!r} (data.text_field; columns: "
                             f"{', '.join(table.column_names)})")
        self.column = table.column(text_field)

    def __len__(self) -> int:
        return len(self.column)

    def __getitem__(self, index: int) -> str:
        return self.column[index].as_py()


def parquet_documents(path: Path, text_field: str) -> ArrowDocuments:
    import pyarrow.parquet as pq

    return ArrowDocuments(pq.read_table(path, columns=[text_field], memory_map=True), text_field, str(path))


def hf_disk_documents(folder: Path, text_field: str, split: str) -> ArrowDocuments:
    """A dataset written by `datasets`' save_to_disk: arrow stream files listed in state.json
    (a DatasetDict has dataset_dict.json and one such folder per split)."""
    import pyarrow as pa

    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        if split not in splits:
            raise ValueError(f"{folder}: no split {split!r} (data.split; splits: {', '.join(splits)})")
        folder = folder / split
    state = json.loads((folder / "state.json").read_text())
    tables = []
    for entry in state["_data_files"]:
        source = pa.memory_map(str(folder / entry["filename"]))
        try:
            tables.append(pa.ipc.open_stream(source).read_all())
        except pa.ArrowInvalid:  # older writers used the random-access file format
            tables.append(pa.ipc.open_file(source).read_all())
    return ArrowDocuments(pa.concat_tables(tables), text_field, str(folder))


class ConcatDocuments:
    def __init__(self, parts: list[Documents]):
        self.parts = parts
        self._ends = []
        total = 0
        for part in parts:
            total += len(part)
            self._ends.append(total)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index: int) -> bytes | str:
        part = bisect_right(self._ends, index)
        start = self._ends[part - 1] if part else 0
        return self.parts[part][index - start]


_SUFFIXES = {".txt": "text", ".md": "text", ".py": "text", ".jsonl": "jsonl", ".parquet": "parquet"}


def _detect_format(path: Path) -> str:
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return "hf_disk"
        kinds = {_SUFFIXES[p.suffix] for p in path.rglob("*") if p.suffix in _SUFFIXES}
        if len(kinds) != 1:
            raise ValueError(f"data.source {path}: cannot tell the format (found {sorted(kinds) or 'no'} files); "
                             "set data.format to text, jsonl, parquet or hf_disk")
        return kinds.pop()
    if path.suffix not in _SUFFIXES:
        raise ValueError(f"data.source {path}: unknown extension {path.suffix!r}; set data.format "
                         f"(files: {', '.join(_SUFFIXES)})")
    return _SUFFIXES[path.suffix]


def open_documents(source: str, *, format: str = "auto", text_field: str = "text", split: str = "train") -> Documents:
    """The documents of `data.source` in `data.format` (see DataConfig)."""
    if source == "stdlib" and format in ("auto", "stdlib"):
        return stdlib_documents()
    if source == "arithmetic_chat":  # generated conversations (data.chat)
        from .arithmetic_chat import ArithmeticChat

        return ArithmeticChat()
    path = Path(source)
    if not path.exists():
        raise ValueError(f"data.source {source!r} does not exist (give 'stdlib' or a file/folder path)")
    kind = _detect_format(path) if format == "auto" else format
    if kind == "hf_disk":
        return hf_disk_documents(path, text_field, split)
    suffixes = [s for s, k in _SUFFIXES.items() if k == kind]
    files = sorted(p for p in path.rglob("*") if p.suffix in suffixes) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"data.source {source}: no {kind} files ({', '.join(suffixes)})")
    if kind == "text":
        return FileDocuments(files)
    if kind == "jsonl":
        return ConcatDocuments([JsonlDocuments(f, text_field) for f in files])
    if kind == "parquet":
        return ConcatDocuments([parquet_documents(f, text_field) for f in files])
    raise ValueError(f"data.format {kind!r} is not one of auto, stdlib, text, jsonl, parquet, hf_disk")

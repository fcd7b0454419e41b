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
    """One document per line of a .jsonl file: the `text_field` of each JSON object.

    Opening reads the whole file once (to index the lines) and checks every record on the way, so a bad
    line stops the run before training, naming the file and the line, not when the loader reaches it."""

    def __init__(self, path: Path, text_field: str, *, strings: bool = True):
        """strings: the field holds text (else anything JSON: chat conversations, checked by data/chat.py)."""
        self.path, self.text_field = path, text_field
        self._offsets = []
        with open(path, "rb") as f:
            offset = 0
            for number, line in enumerate(f, start=1):
                if line.strip():
                    _check_jsonl_record(path, number, line, text_field, strings=strings)
                    self._offsets.append(offset)
                offset += len(line)
        self._file = None

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index: int) -> str:
        if self._file is None:
            self._file = open(self.path, "rb")
        self._file.seek(self._offsets[index])
        return json.loads(self._file.readline())[self.text_field]


def _check_jsonl_record(path: Path, number: int, line: bytes, text_field: str, *, strings: bool = True) -> None:
    """ValueError naming `path` and the 1-based line `number` unless the line is a UTF-8 JSON object
    whose `text_field` is a string."""
    where = f"{path}: line {number}"
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        byte = line[e.start:e.start + 1]
        raise ValueError(f"{where} is not UTF-8 (byte {e.start + 1} of the line is {byte!r})") from None
    except json.JSONDecodeError as e:
        cut = "; the file ends inside this record (truncated?)" if not line.endswith(b"\n") else ""
        raise ValueError(f"{where} is not valid JSON ({e.msg} at column {e.colno}){cut}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object with a {text_field!r} field")
    if text_field not in record:
        raise ValueError(f"{where} has no field {text_field!r} (data.text_field; it has {', '.join(record) or 'none'})")
    text = record[text_field]
    if strings and not isinstance(text, str):
        shown = "null" if text is None else f"a JSON {type(text).__name__}"
        raise ValueError(f"{where}: field {text_field!r} is {shown}, not a string")


class ArrowDocuments:
    """The string column `text_field` of an Arrow table (parquet files, saved HF datasets)."""

    def __init__(self, table, text_field: str, origin: str, *, strings: bool = True):
        import pyarrow as pa
        import pyarrow.compute as pc

        if text_field not in table.column_names:
            raise ValueError(f"{origin}: no column {text_field!r} (data.text_field; columns: "
                             f"{', '.join(table.column_names)})")
        self.column = table.column(text_field)
        kind = self.column.type
        if strings and not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ValueError(f"{origin}: column {text_field!r} holds {kind}, not strings (data.text_field)")
        if self.column.null_count:
            row = pc.index(pc.is_null(self.column), True).as_py()
            raise ValueError(f"{origin}: row {row + 1} of column {text_field!r} is null, not a string")

    def __len__(self) -> int:
        return len(self.column)

    def __getitem__(self, index: int) -> str:
        return self.column[index].as_py()


def parquet_documents(path: Path, text_field: str, *, strings: bool = True) -> ArrowDocuments:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        columns = pq.read_schema(path).names
        if text_field not in columns:
            raise ValueError(f"{path}: no column {text_field!r} (data.text_field; columns: {', '.join(columns)})")
        table = pq.read_table(path, columns=[text_field], memory_map=True)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path} is not a readable parquet file ({e})") from None
    return ArrowDocuments(table, text_field, str(path), strings=strings)


def hf_disk_documents(folder: Path, text_field: str, split: str, *, strings: bool = True) -> ArrowDocuments:
    """A dataset written by `datasets`' save_to_disk: arrow stream files listed in state.json
    (a DatasetDict has dataset_dict.json and one such folder per split)."""
    import pyarrow as pa

    if (folder / "dataset_dict.json").is_file():
        splits = _json_field(folder / "dataset_dict.json", "splits")
        if split not in splits:
            raise ValueError(f"{folder}: no split {split!r} (data.split; splits: {', '.join(splits)})")
        folder = folder / split
    if not (folder / "state.json").is_file():
        raise ValueError(f"{folder} holds neither state.json nor dataset_dict.json: not a dataset saved with "
                         "save_to_disk (data.format hf_disk)")
    tables = []
    for entry in _json_field(folder / "state.json", "_data_files"):
        file = folder / entry["filename"]
        try:
            source = pa.memory_map(str(file))
            try:
                tables.append(pa.ipc.open_stream(source).read_all())
            except pa.ArrowInvalid:  # older writers used the random-access file format
                tables.append(pa.ipc.open_file(source).read_all())
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{file} is not a readable Arrow file ({e})") from None
    return ArrowDocuments(pa.concat_tables(tables), text_field, str(folder), strings=strings)


def _json_field(path: Path, field: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))[field]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a JSON object with a {field!r} field ({e})") from None


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


def open_documents(source: str, *, format: str = "auto", text_field: str = "text", split: str = "train",
                   strings: bool = True) -> Documents:
    """The documents of `data.source` in `data.format` (see DataConfig). strings=False: records whose field
    holds other JSON (chat conversations)."""
    if source == "stdlib" and format in ("auto", "stdlib"):
        return stdlib_documents()
    if source == "arithmetic_chat":  # generated conversations (data.chat)
        from .arithmetic_chat import ArithmeticChat

        return ArithmeticChat()
    path = Path(source)
    if not path.exists():
        raise ValueError(f"data.source {source!r} does not exist (give 'stdlib' or a file/folder path)")
    kind = _detect_format(path) if format == "auto" else format
    if format != "auto":
        _check_format_matches(path, kind)
    if kind == "hf_disk":
        return hf_disk_documents(path, text_field, split, strings=strings)
    suffixes = [s for s, k in _SUFFIXES.items() if k == kind]
    files = sorted(p for p in path.rglob("*") if p.suffix in suffixes) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"data.source {source}: no {kind} files ({', '.join(suffixes)})")
    if kind == "text":
        return FileDocuments(files)
    if kind == "jsonl":
        return ConcatDocuments([JsonlDocuments(f, text_field, strings=strings) for f in files])
    if kind == "parquet":
        return ConcatDocuments([parquet_documents(f, text_field, strings=strings) for f in files])
    raise ValueError(f"data.format {kind!r} is not one of auto, stdlib, text, jsonl, parquet, hf_disk")


_PARQUET_MAGIC = b"PAR1"


def _check_format_matches(path: Path, kind: str) -> None:
    """ValueError when an explicit data.format contradicts the source: a folder for a file format or the
    reverse, another format's extension, a parquet file read as text or jsonl, or the reverse."""
    if kind == "stdlib":
        raise ValueError(f"data.format=stdlib reads Python's own library; data.source must be 'stdlib', "
                         f"not {str(path)!r}")
    if kind == "hf_disk":
        if not path.is_dir():
            raise ValueError(f"data.format=hf_disk needs a folder saved with save_to_disk, but {path} is a file")
        return
    if path.is_dir():
        return  # the files of that format in the folder are read (and checked as they are opened)
    named = _SUFFIXES.get(path.suffix)
    if named is not None and named != kind:
        raise ValueError(f"data.format={kind} but {path} has the extension of a {named} file; set data.format "
                         f"{named} (or auto)")
    with open(path, "rb") as f:
        head = f.read(4096)
    if kind == "parquet" and not head.startswith(_PARQUET_MAGIC):
        raise ValueError(f"data.format=parquet but {path} is not a parquet file (no PAR1 header)")
    if kind != "parquet" and head.startswith(_PARQUET_MAGIC):
        raise ValueError(f"data.format={kind} but {path} is a parquet file; set data.format parquet (or auto)")

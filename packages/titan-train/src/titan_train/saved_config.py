"""The run's config beside its checkpoints (<job.folder>/train_config.json), so `titan-train export` and
later tools rebuild the model the checkpoints belong to without the original command line."""
from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

from .cli_args import check_types, field_types, section_types
from .config import TrainConfig

FILE = "train_config.json"


def save_config(config: TrainConfig, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / f".{FILE}.tmp"
    temporary.write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n", encoding="utf-8")
    temporary.replace(folder / FILE)  # whole or not at all


def load_config(folder: Path) -> TrainConfig:
    """The TrainConfig a titan-train run saved in `folder` (ValueError naming the file when there is none)."""
    path = Path(folder) / FILE
    if not path.is_file():
        raise ValueError(f"{folder} is not a titan-train job folder: it has no {FILE}")
    saved = json.loads(path.read_text(encoding="utf-8"))
    config = TrainConfig()
    for section, section_cls in section_types(config).items():
        values = getattr(config, section)
        for name, tp in field_types(section_cls).items():
            if name in saved.get(section, {}):
                setattr(values, name, _as_type(saved[section][name], tp))
    check_types(config)
    return config


def _as_type(value, tp):
    """JSON lists back to the tuples the config's types declare."""
    if typing.get_origin(tp) is tuple and isinstance(value, list):
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_as_type(v, args[0]) for v in value)
        return tuple(_as_type(v, a) for v, a in zip(value, args))
    return value

"""--checkpoint.initial_load: a run's first weights from a titan-train checkpoint or a Hugging Face folder,
model only (no optimizer, schedule or data position), into any layout."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

import titan_models as tm

ADAPTER_NAMES = ("lora_a", "lora_b")


def _is_base(name: str) -> bool:
    return name.rpartition(".")[2] not in ADAPTER_NAMES


class BaseWeights:
    """A model's state without LoRA adapters (what a checkpoint of a plain run, or a HF folder, holds)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in get_model_state_dict(self.model).items() if _is_base(k)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=False))


def checkpoint_folder(path: Path) -> Path | None:
    """The checkpoints folder of a job folder or the folder itself, when it holds committed steps."""
    for folder in (path / "checkpoints", path):
        if folder.is_dir() and any(child.name.startswith("step-") for child in folder.iterdir()):
            return folder
    return None


def load_initial_weights(model: nn.Module, path: str, *, pipeline=None) -> str:
    """Fill `model` (this rank's share of it) from `path`; returns what was loaded, for the run's announcement."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"checkpoint.initial_load: {path!r} is not a folder")
    checkpoints = checkpoint_folder(folder)
    if checkpoints is not None:
        from torch_checkpointing import Checkpointer

        with Checkpointer(str(checkpoints)) as checkpointer:
            state = {"model": BaseWeights(model)}
            if pipeline is not None:
                state = pipeline.checkpoint_entries(state)
            step = checkpointer.load(state)
        return f"{checkpoints} step {step}"
    if (folder / "config.json").is_file():
        _load_hf(model, folder)
        return str(folder)
    raise ValueError(f"checkpoint.initial_load: {path} holds neither titan-train checkpoints (step-N folders) nor a "
                     "Hugging Face model (config.json + safetensors)")


def _load_hf(model: nn.Module, folder: Path) -> None:
    distributed = dist.is_initialized()
    full: dict[str, torch.Tensor] = {}
    if not distributed or dist.get_rank() == 0:
        dtype = next(p.dtype for p in model.parameters())
        try:
            full = tm.from_hf(folder, dtype=dtype).state_dict()
        except (OSError, ValueError) as e:
            raise ValueError(f"checkpoint.initial_load: {e}") from None
        missing = sorted(n for n in model.state_dict() if _is_base(n) and n not in full)
        if missing:
            raise ValueError(f"checkpoint.initial_load: {folder} lacks {missing[:5]} ({len(missing)} tensors) of the "
                             "model the recipe builds")
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed,
                                                               strict=False))

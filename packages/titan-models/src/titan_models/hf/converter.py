"""What each family's Hugging Face converter provides (see models/llama3/hf.py for the simplest)."""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from titan_models.components.norms import RMSNormConfig


class Converter:
    architectures: tuple[str, ...] = ()  # HF `architectures` entries this converter reads
    config_type: type = object

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> Any:
        raise NotImplementedError

    def config_to_hf(self, config: Any) -> dict[str, Any]:
        raise NotImplementedError

    def hf_names(self, config: Any, name: str) -> list[str]:
        """HF tensors holding titan tensor `name` (several = stacked experts; none = not stored, zero)."""
        raise NotImplementedError

    def hf_shapes(self, config: Any, name: str, shape: tuple[int, ...], present: set[str]) -> dict[str, tuple[int, ...]]:
        """HF tensors that hold titan tensor `name` (of `shape`), each with its shape on disk. `present`
        names the folder's tensors when reading (a converter may accept several layouts), empty when writing."""
        names = self.hf_names(config, name)
        per_tensor = shape[1:] if len(names) > 1 else shape
        return {hf_name: per_tensor for hf_name in names}

    def load(self, config: Any, name: str, files: Any, present: set[str]) -> torch.Tensor | None:
        """Titan tensor `name` read from `files` (a SafetensorsFolder); None when it is not stored (zero)."""
        names = list(self.hf_shapes(config, name, (), present))
        if not names:
            return None
        if len(names) == 1:
            return files.get(names[0])
        return torch.stack([files.get(n) for n in names])

    def to_hf_tensor(self, config: Any, hf_name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The HF tensor `hf_name` from the titan tensors that map to it alone (one, unless fused on disk)."""
        assert len(parts) == 1, f"{hf_name} is written from {sorted(parts)}; the converter must say how"
        return next(iter(parts.values()))

    def ignorable(self, config: Any, hf_name: str) -> bool:
        """HF tensors that may be present without being loaded (derived or duplicated data)."""
        return bool(re.fullmatch(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", hf_name)) or (
            config.tie_embeddings and hf_name == "lm_head.weight")

    def extra_tensors(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """Tensors written besides the mapped state (e.g. duplicates a format expects)."""
        return []


def require(hf: dict[str, Any], field: str, allowed: tuple[Any, ...], default: Any) -> None:
    value = hf.get(field, default)
    if value not in allowed:
        raise ValueError(f"config.json field {field}={value!r} is not supported; supported: {list(allowed)}")


def rms_eps(config: Any) -> float:
    if not isinstance(config.norm, RMSNormConfig):
        raise ValueError(f"Hugging Face {config.family} models use RMSNorm; this config has {config.norm}")
    return config.norm.eps


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

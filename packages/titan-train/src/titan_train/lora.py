"""LoRA (Hu et al., 2021): trainable low-rank adapters beside frozen Linears, applied as a titan-models
component override (the replacement keeps the Linear's own weight and bias names, so base weights load as
before, and adds `lora_a` / `lora_b`).

y = x W^T + b + (alpha / r) dropout(x) A^T B^T, with A [r, in] and B [out, r]; B starts at zero, so the
adapted model starts as the base model. merge() folds the product into W for export.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import titan_models as tm


class LoRALinear(nn.Linear):
    """An nn.Linear (the same weight and bias Parameters) with a low-rank adapter."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, rank, device=device, dtype=dtype))
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(self.dropout(x), self.lora_a),
                                                              self.lora_b) * self.scaling

    def merged(self) -> nn.Linear:
        """A plain Linear whose weight is W + (alpha / r) B A."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.weight + (self.lora_b @ self.lora_a) * self.scaling)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear


class LoRA:
    """Which Linears get adapters (patterns), with what rank, alpha and dropout; `seed` draws the A matrices."""

    def __init__(self, targets: tuple[str, ...], *, rank: int, alpha: float, dropout: float, seed: int):
        self.targets, self.rank, self.alpha, self.dropout, self.seed = targets, rank, alpha, dropout, seed

    def apply(self, model: nn.Module) -> list[str]:
        """Put adapters on the matching Linears and freeze everything else; returns the adapted names."""
        def adapter(name: str, module: nn.Module) -> nn.Module:
            if type(module) is not nn.Linear:
                raise ValueError(f"lora.targets: {name} is a {type(module).__name__}, not an nn.Linear")
            return LoRALinear(module, rank=self.rank, alpha=self.alpha, dropout=self.dropout)

        adapted = []
        for pattern in self.targets:
            adapted += tm.override(model, pattern, adapter, adds_parameters=True)
        for name, param in model.named_parameters():
            param.requires_grad_(name.rpartition(".")[2] in ("lora_a", "lora_b"))
        return adapted

    def reset(self, model: nn.Module) -> None:
        """The adapters' initial values: A kaiming-uniform from a generator seeded by (seed, its name), as
        nn.Linear initialises; B zero. The same on any layout (each rank keeps its shard of the whole)."""
        with torch.no_grad():
            for name, module in model.named_modules():
                if isinstance(module, LoRALinear):
                    generator = torch.Generator().manual_seed(self.seed * 1_000_003 + _name_hash(name))
                    bound = 1 / math.sqrt(module.in_features)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear's weight
                    a = torch.empty(module.lora_a.shape).uniform_(-bound, bound, generator=generator)
                    _copy_whole(module.lora_a, a)
                    _copy_whole(module.lora_b, torch.zeros(module.lora_b.shape))


def merge(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear of `model` (full tensors, one process) by its merged Linear, in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.merged())
    return model


def _name_hash(name: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % 1_000_003  # stable across processes (unlike hash)


def _copy_whole(param: torch.Tensor, whole: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        shard = distribute_tensor(whole.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(whole)

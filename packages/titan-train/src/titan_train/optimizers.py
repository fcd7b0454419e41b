"""The optimizer of a run: AdamW (torch) or Muon (flexshard), by optimizer.name.

Both decay matrices only: norms, biases and other vectors get weight_decay 0. Under Muon, flexshard's
rule picks the hidden matrices (2-D and up, stacked experts as a batch of matrices) for Muon at
`muon_lr`; embeddings, the output head and vectors get AdamW at `lr`. The learning-rate schedule scales
every group alike.

AdamW keeps MoE router gates in a group of their own: under expert parallelism they stay plain
(replicated) tensors while every other parameter is a DTensor, and one foreach or fused kernel call
cannot mix the two. The group exists whenever the model has MoE layers, whatever the layout, so the
optimizer's groups (which a checkpoint records) are the same in every layout and a checkpoint resumes
in another one.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .config import OptimizerConfig

_NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_MOMENT_DTYPES = _NS_DTYPES


def build_optimizer(config: OptimizerConfig, model: nn.Module, *, device: torch.device,
                    param_dtype: torch.dtype | None = None) -> torch.optim.Optimizer:
    """param_dtype (AdamW only): keep the fp32 parameters as master weights in the optimizer and give the
    model `param_dtype` parameters (MasterWeightAdamW; training.mixed_precision=bf16_params)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [(n, p) for n, p in named if p.ndim >= 2]
    vectors = [p for _, p in named if p.ndim < 2]
    if config.name == "adamw":
        impl = config.implementation
        if impl == "auto":
            impl = "fused" if device.type == "cuda" else "foreach"
        kernels = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[impl]
        routers = [p for n, p in matrices if n.endswith("router.gate.weight")]
        groups = [{"params": [p for n, p in matrices if not n.endswith("router.gate.weight")],
                   "weight_decay": config.weight_decay},
                  {"params": vectors, "weight_decay": 0.0}]
        if routers:
            groups.append({"params": routers, "weight_decay": config.weight_decay})
        if param_dtype is not None:
            from .master_adamw import MasterWeightAdamW

            return MasterWeightAdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                                     param_dtype=param_dtype, moment_dtype=_MOMENT_DTYPES[config.moment_dtype])
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, **kernels)
    if config.name != "muon":
        raise ValueError(f"optimizer.name must be adamw or muon, got {config.name!r}")
    if param_dtype is not None:
        raise ValueError("training.mixed_precision=bf16_params keeps its master weights in AdamW; "
                         "use optimizer.name=adamw, or mixed_precision=bf16 with muon")
    if config.muon_ns_steps < 1:
        raise ValueError(f"optimizer.muon_ns_steps must be >= 1, got {config.muon_ns_steps}")
    from flexshard.optim import Muon

    optimizer = Muon(matrices, lr=config.muon_lr, momentum=config.muon_momentum, nesterov=True,
                     ns_steps=config.muon_ns_steps, ns_dtype=_NS_DTYPES[config.muon_ns_dtype],
                     weight_decay=config.weight_decay,
                     adjust_lr=None if config.muon_adjust_lr == "none" else config.muon_adjust_lr,
                     adamw_lr=config.lr, adamw_betas=(config.beta1, config.beta2), adamw_eps=config.eps,
                     adamw_weight_decay=config.weight_decay)
    if vectors:  # AdamW without decay; the other settings come from Muon's defaults
        optimizer.add_param_group({"params": vectors, "use_muon": False, "lr": config.lr, "weight_decay": 0.0})
    return optimizer


"""activation_checkpoint.mode=remat applied: each block wrapped as its plan says, the plan reported."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from ..config import ActivationCheckpointConfig
from .measure import profile_blocks
from .peak import StaticMemory, block_transient, peak_model, planned_under_budget
from .plan import GIB, explicit_plan, normalize_op
from .report import plan_report, summary_line
from .wrap import wrap_block


def apply_remat(model: nn.Module, config: ActivationCheckpointConfig, *, rows: int, seq_len: int,
                activation_dtype: torch.dtype, memory: StaticMemory, folder: Path | None,
                compiled: bool = False) -> dict:
    """Plan (explicit lists or the budget, against peak.py's peak model), wrap the blocks, print the plan and
    write <folder>/remat_plan.json (folder None: not this rank's job); returns the plan's report. compiled: the
    blocks will be compiled whole (a kept block then saves what the compiled graph does, measure.py)."""
    explicit = () if config.memory_budget_gib else (tuple(normalize_op(o) for o in config.save_ops),)
    profiles = profile_blocks(model, rows=rows, seq_len=seq_len, dtype=activation_dtype, compiled=compiled,
                              extra_options=explicit)
    gradients = block_gradients(model, memory.gradient_bytes)
    budget = None
    if config.memory_budget_gib:
        budget = int(config.memory_budget_gib * GIB)
        choices, peak = planned_under_budget(profiles, budget, memory, gradients)
    else:
        choices = explicit_plan(profiles, config.save_ops, config.save_blocks)
        peak = peak_model(choices, gradients, memory, block_transient(profiles))
    for choice in choices:
        name = choice.path.removeprefix("layers.")
        if choice.save_ops is None:
            continue
        model.layers[name] = wrap_block(model.layers[name], choice.save_ops)
    report = plan_report(choices, profiles, memory=memory, peak=peak, transient_bytes=block_transient(profiles),
                         budget_bytes=budget)
    if folder is not None:
        print(summary_line(report), flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "remat_plan.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def block_gradients(model: nn.Module, gradient_bytes: int) -> list[int]:
    """Each block's share of the gradient bytes, by its parameter count."""
    total = sum(p.numel() for p in model.parameters())
    return [gradient_bytes * sum(p.numel() for p in block.parameters()) // max(total, 1)
            for block in model.layers.values()]

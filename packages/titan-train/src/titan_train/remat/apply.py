"""activation_checkpoint.mode=remat applied: each block wrapped as its plan says, the plan reported."""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

from ..config import ActivationCheckpointConfig
from .measure import op_name, profile_blocks
from .peak import StaticMemory, block_transient, peak_model, peak_plan
from .plan import GIB, explicit_plan
from .report import plan_report, summary_line


def _policy(save_ops: tuple[str, ...]):
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):
        name = op_name(op)
        if name in save_ops or ("flex_attention" in name and "flex_attention" in save_ops):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def apply_remat(model: nn.Module, config: ActivationCheckpointConfig, *, rows: int, seq_len: int,
                activation_dtype: torch.dtype, memory: StaticMemory, folder: Path | None,
                compiled: bool = False) -> dict:
    """Plan (explicit lists or the budget, against peak.py's peak model), wrap the blocks, print the plan and
    write <folder>/remat_plan.json (folder None: not this rank's job); returns the plan's report. compiled: the
    blocks will be compiled whole (a kept block then saves what the compiled graph does, measure.py)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    profiles = profile_blocks(model, rows=rows, seq_len=seq_len, dtype=activation_dtype, compiled=compiled)
    gradients = block_gradients(model, memory.gradient_bytes)
    budget = None
    if config.memory_budget_gib:
        budget = int(config.memory_budget_gib * GIB)
        choices, peak = peak_plan(profiles, budget, memory, gradients)
    else:
        choices = explicit_plan(profiles, config.save_ops, config.save_blocks)
        peak = peak_model(choices, gradients, memory, block_transient(profiles))
    for choice in choices:
        name = choice.path.removeprefix("layers.")
        if choice.save_ops is None:
            continue
        block = model.layers[name]
        if choice.save_ops:
            context = partial(create_selective_checkpoint_contexts, _policy(choice.save_ops))
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context)
        else:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    report = plan_report(choices, memory=memory, peak=peak, transient_bytes=block_transient(profiles),
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

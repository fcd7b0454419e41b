"""Learning-rate schedules as a multiplier of the peak rate for each step (a LambdaLR factor)."""
from __future__ import annotations

import math

from .config import LRScheduleConfig


def lr_factor(step: int, total_steps: int, config: LRScheduleConfig) -> float:
    """Multiplier of the peak learning rate used by optimizer step `step` (0-based)."""
    warmup = config.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)  # never 0: the first step already learns
    floor = config.min_lr_ratio
    if config.kind == "constant":
        return 1.0
    if config.kind == "cosine":
        progress = (step - warmup) / max(total_steps - warmup, 1)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    # Warmup-stable-decay: flat at the peak, then decay over the last `decay_fraction` of the steps.
    decay_steps = max(int(round(config.decay_fraction * total_steps)), 1)
    decay_start = max(total_steps - decay_steps, warmup)
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start + 1) / max(total_steps - decay_start, 1), 1.0)
    if config.decay_shape == "linear":
        remaining = 1 - progress
    elif config.decay_shape == "sqrt":
        remaining = 1 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (1 - floor) * remaining


def validate(config: LRScheduleConfig) -> None:
    if config.warmup_steps < 0:
        raise ValueError(f"lr_schedule.warmup_steps must be >= 0, got {config.warmup_steps}")
    if not 0 <= config.decay_fraction <= 1:
        raise ValueError(f"lr_schedule.decay_fraction must be in [0, 1], got {config.decay_fraction}")
    if not 0 <= config.min_lr_ratio <= 1:
        raise ValueError(f"lr_schedule.min_lr_ratio must be in [0, 1], got {config.min_lr_ratio}")

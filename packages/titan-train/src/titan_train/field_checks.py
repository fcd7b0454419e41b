"""Value checks of run fields whose type alone lets a wrong run through: a NaN or negative clipping
norm (a negative one flips every gradient), an empty job folder (the working directory would fill with
the run's files), a seed torch's generators cannot take (the data order seeds with seed * 1_000_003 +
epoch)."""
from __future__ import annotations

import math

from .config import TrainConfig

SEED_LIMIT = 2**32


def check_run_fields(config: TrainConfig) -> None:
    """ValueError naming the first field whose value cannot make a sound run."""
    if not config.job.folder.strip():
        raise ValueError("job.folder is empty; give the folder the run writes metrics and checkpoints to")
    seed = config.job.seed
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"job.seed must be in [0, 2**32), got {seed}")
    norm = config.training.max_grad_norm
    if not (math.isfinite(norm) and norm >= 0):
        raise ValueError(f"training.max_grad_norm must be a finite number >= 0 (0 disables clipping), got {norm}")
    o = config.optimizer
    if o.moment_dtype != "float32" and config.training.mixed_precision != "bf16_params":
        raise ValueError(f"optimizer.moment_dtype={o.moment_dtype} applies to the master-weight AdamW of "
                         "training.mixed_precision=bf16_params (other modes keep torch's AdamW, whose moments "
                         f"follow the parameters' dtype); got mixed_precision={config.training.mixed_precision}")
    for name in ("lr", "eps", "weight_decay", "muon_lr"):
        value = getattr(o, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"optimizer.{name} must be a finite number >= 0, got {value}")
    for name in ("beta1", "beta2", "muon_momentum"):
        value = getattr(o, name)
        if not 0 <= value < 1:
            raise ValueError(f"optimizer.{name} must be in [0, 1), got {value}")

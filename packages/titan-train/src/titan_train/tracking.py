"""Weights & Biases as one more sink of the metrics records (optional: pip install 'titan-train[wandb]')."""
from __future__ import annotations

import os
from pathlib import Path


class WandbSink:
    def __init__(self, folder: Path, *, project: str, mode: str, config: dict | None):
        try:
            import wandb  # the optional extra, imported only when asked for
        except ImportError:
            raise ValueError("metrics.wandb=true needs Weights & Biases: pip install 'titan-train[wandb]' "
                             "(or set metrics.wandb false)") from None
        mode = os.environ.get("WANDB_MODE", "online") if mode == "auto" else mode
        self.run = wandb.init(project=project, name=folder.name, dir=str(folder), mode=mode, config=config or {})

    def write(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))},
                     step=record["step"])

    def close(self) -> None:
        self.run.finish()

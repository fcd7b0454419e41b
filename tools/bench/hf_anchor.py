"""The Hugging Face transformers side of the training benchmarks' anchors (train_throughput, vlm).

What both benchmarks share: AdamW set up as titan-train sets it up (weight decay on matrices only, fused on
CUDA, foreach on CPU), titan-train's lr warm-up, the timed training-step loop, and the loss check of one run
against another. A step is timed from a synchronised start to the loss read back after optimizer.step (a
host sync), the batch drawn inside it, as titan-train's Trainer (metrics.log_interval 1) times its own.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warmup_factor(warmup: int) -> Callable[[int], float]:
    """titan-train's lr factor for lr_schedule.kind=constant with `warmup` warm-up steps (step 0-based)."""
    return lambda step: (step + 1) / (warmup + 1) if step < warmup else 1.0


def adamw(model: torch.nn.Module, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
          device: torch.device) -> torch.optim.AdamW:
    """torch's AdamW over `model`'s trainable parameters, decaying the matrices only (titan-train's groups)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    kernels = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kernels)


def train_steps(model: Callable, optimizer: torch.optim.Optimizer, batches: Iterator[dict], *, steps: int,
                warmup: int, clip: float, device: torch.device, label: str) -> dict[str, list[float]]:
    """`steps` training steps of `model` (called with each batch's keyword arguments, returning an output
    with .loss) under titan-train's constant-with-warm-up lr schedule and gradient clipping at `clip`.
    Returns {"losses": [...], "seconds": [...]}, one entry per step."""
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_factor(warmup))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    losses, seconds = [], []
    for _ in range(steps):
        sync(device)
        began = time.perf_counter()
        inputs = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                  for k, v in next(batches).items()}
        loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the host sync that ends the step
        seconds.append(time.perf_counter() - began)
        print(f"  {label} step {len(losses)}: loss {losses[-1]:.4f}  {seconds[-1] * 1e3:.0f} ms", flush=True)
    return {"losses": losses, "seconds": seconds}


def loss_gap(losses: list[float], reference: list[float], *, steps: int) -> float:
    """The largest relative gap between two runs' losses over their first `steps` steps."""
    n = min(len(losses), len(reference), steps)
    assert n > 0, "no common steps to compare"
    return max(abs(a - b) / abs(b) for a, b in zip(losses[:n], reference[:n]))

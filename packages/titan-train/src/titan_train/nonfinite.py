"""Stopping a run at its first non-finite loss or gradient norm, without reading them back every step.

Where the optimizer can skip an update on the device (torch's fused AdamW, the default on CUDA: its
kernel leaves parameters, moments and step count alone while `found_inf` is 1, the mechanism
GradScaler uses), the step's finiteness is computed on the device and latched: from the first
non-finite step on, every update is skipped, so the weights stay those of the last good step. The
flag is read back once per log interval, before a checkpoint is written and at the end of the run,
and the run stops naming the first bad step. A finite run is bitwise the same as without the guard
(found_inf 0 changes no arithmetic).

With an optimizer that has no found_inf (foreach/for-loop AdamW, the CPU default, where reading a value
back costs nothing because the ops have already run; MasterWeightAdamW; Muon) the step is checked on
the host before the update, as before.
"""
from __future__ import annotations

import math

import torch


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) of a step was NaN or inf; neither that step nor a later one was applied
    nor checkpointed."""

    def __init__(self, step: int, loss: float, grad_norm: float):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        what = "loss" if not math.isfinite(loss) else "gradient norm"
        super().__init__(f"non-finite {what} at step {step} (loss {loss}, grad norm {grad_norm}); the step was "
                         "not applied and no checkpoint was written for it")


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours a `found_inf` tensor: torch's Adam/AdamW with fused=True."""
    return (type(optimizer) in (torch.optim.AdamW, torch.optim.Adam)
            and all(group.get("fused") for group in optimizer.param_groups))


class NonFiniteGuard:
    """Call `before_update` between the backward and `optimizer.step()`, `check` where the run reads back."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer = optimizer
        self.on_device = skips_on_device(optimizer)
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        self.first_bad = torch.zeros(3, dtype=torch.float64, device=device)  # (step, loss, grad norm)

    def before_update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """loss, grad_norm: this step's 0-dim tensors. On the host path raises NonFiniteLossError now; on the
        device path marks this step (and every later one) to be skipped if any was non-finite."""
        if not self.on_device:
            values = torch.stack([loss.float(), grad_norm.float()]).tolist()
            if not all(math.isfinite(v) for v in values):
                raise NonFiniteLossError(step, *values)
            return
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        record = torch.stack([torch.full_like(loss, step, dtype=torch.float64), loss.double(), grad_norm.double()])
        self.first_bad = torch.where(self.bad | finite, self.first_bad, record)
        self.bad = self.bad | ~finite
        self.optimizer.found_inf = self.bad.float()  # read by the fused kernel: 1 skips the whole update

    def check(self) -> None:
        """Raise NonFiniteLossError for the first non-finite step so far (a read-back on the device path)."""
        if self.on_device and bool(self.bad):
            step, loss, grad_norm = self.first_bad.tolist()
            raise NonFiniteLossError(int(step), loss, grad_norm)

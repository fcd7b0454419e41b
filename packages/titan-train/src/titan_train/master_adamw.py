"""AdamW for a model whose parameters are bf16, with fp32 master weights kept in the optimizer.

The model then runs in bf16 end to end, as FSDP's bf16 mixed-precision policy runs it: no autocast,
no fp32-to-bf16 cast of every weight in every forward and no bf16-to-fp32 cast of every gradient in
backward. The fp32 copies and both moments live in the optimizer's state ("master", "exp_avg",
"exp_avg_sq", "step"), so a checkpoint saves and restores them like any optimizer state; each step
updates the master weight and writes its bf16 rounding into the parameter (kernels/adamw.py, one
pass on CUDA). Numerically the update is torch.optim.AdamW's on the fp32 master.

moment_dtype=bf16 (optimizer.moment_dtype) keeps the two moments in bf16, as torch's AdamW does for a
bf16 model: 12 bytes a parameter with the bf16 weight and gradient instead of 16 (on the 1.5B Llama of
tools/bench/train_throughput, 5.6 GiB less).
"""
from __future__ import annotations

from itertools import chain

import torch

from .kernels.adamw import adamw_master_step


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over `params` (fp32 when given), which it turns into `param_dtype` copies of themselves.

    Construction keeps each fp32 parameter's values as its master weight, then gives the parameter a
    `param_dtype` tensor: build it after the weights are initialised or loaded. The whole state exists
    from construction (zero moments, step 0), so a checkpoint loads into it in place."""

    def __init__(self, params, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, param_dtype: torch.dtype = torch.bfloat16,
                 moment_dtype: torch.dtype = torch.float32):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        if moment_dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"MasterWeightAdamW keeps its moments in float32 or bfloat16, got {moment_dtype}")
        self.moment_dtype = moment_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise TypeError(f"MasterWeightAdamW takes fp32 parameters (it keeps them as the master "
                                    f"weights), got {p.dtype}")
                master = p.detach().clone(memory_format=torch.contiguous_format)
                p.data = master.to(param_dtype, copy=True)
                self.state[p] = {"step": torch.tensor(0.0), "master": master,
                                 "exp_avg": torch.zeros_like(master, dtype=moment_dtype),
                                 "exp_avg_sq": torch.zeros_like(master, dtype=moment_dtype)}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                adamw_master_step(p, p.grad, state["master"], state["exp_avg"], state["exp_avg_sq"],
                                  step=int(state["step"]), lr=group["lr"], beta1=beta1, beta2=beta2,
                                  eps=group["eps"], weight_decay=group["weight_decay"])
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then the master weights put back in fp32 and the moments in moment_dtype (torch
        casts optimizer state to the parameter's dtype, which would round them to bf16)."""
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if key != "step" and torch.is_tensor(value):
                    dtype = torch.float32 if key == "master" else self.moment_dtype
                    self.state[p][key] = value.to(device=p.device, dtype=dtype, copy=True)

"""compile.graph_optimizer: torch's AdamW update as a second captured graph, run right after the step's.

The graph is traced once (make_fx on the real tensors: the trace performs that step's update) and replayed
every later step. What changes from step to step enters it as tensors, so one graph serves every step:
the step counts (the optimizer's own state tensors, incremented in the graph), and the learning rate.

- fused (the CUDA default; torch also has it on CPU): the graph holds torch's `_fused_adamw_` with its
  tensor-lr overload, which reads a CPU lr tensor as the double the float overload takes, and the
  `found_inf` NonFiniteGuard hands it. The kernel derives the bias corrections from the step tensors.
- foreach / for-loop (the CPU default): eager AdamW derives its per-step scalars on the host in Python
  double (1 - lr*wd, sqrt(1 - beta2^t), -lr / (1 - beta1^t)), and so does this class, from the same lr
  and step values; they enter the graph as one float64 tensor per group. Computing them in the graph
  instead (float64 pow and sqrt kernels) could differ from Python's libm pow in the last bit. The tensor
  ops are the ones torch's CPU foreach path runs per tensor (it has no fused CPU loops), with tensor-scalar
  overloads (mul_ and div_ by a 0-dim tensor, _foreach_addcdiv_.Tensor) that compute with the same values.
  On CUDA foreach launches multi-tensor kernels of its own, which this graph does not reproduce: refused.

Under FSDP the update is elementwise on each rank's shards, as DTensor runs it: the graph gets the local
tensors. Muon and MasterWeightAdamW (training.mixed_precision=bf16_params) are refused (ValueError).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx

from .capture import write_graph


def check_graph_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """ValueError naming what compile.graph_optimizer cannot capture."""
    if type(optimizer) is not torch.optim.AdamW:
        raise ValueError(f"compile.graph_optimizer captures torch.optim.AdamW only, this run's optimizer is "
                         f"{type(optimizer).__name__} (optimizer.name=muon and training.mixed_precision="
                         "bf16_params are not captured; set compile.graph_optimizer=false)")
    fused = {bool(group["fused"]) for group in optimizer.param_groups}
    if len(fused) != 1:
        raise ValueError("compile.graph_optimizer: AdamW groups mix fused and unfused kernels")
    for group in optimizer.param_groups:
        for key in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group[key]:
                raise ValueError(f"compile.graph_optimizer does not capture AdamW with {key}=True")
    if device.type == "cuda" and not fused.pop():
        raise ValueError("compile.graph_optimizer on CUDA captures the fused AdamW only (foreach's CUDA "
                         "multi-tensor kernels are not what the captured per-tensor ops compute); set "
                         "optimizer.implementation=fused or auto")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class GraphAdamW:
    """graph_adamw.step() does what optimizer.step() does, by running the captured update graph; the
    state stays in `optimizer` (checkpoints save and load it as before)."""

    def __init__(self, optimizer: torch.optim.AdamW, *, device: torch.device, dump_folder: Path | None):
        check_graph_optimizer(optimizer, device)
        self.optimizer, self.dump_folder = optimizer, dump_folder
        self.fused = bool(optimizer.param_groups[0]["fused"])
        self.graphs: dict[tuple, fx.GraphModule] = {}

    def _state(self, p: torch.Tensor) -> dict:
        """The parameter's AdamW state, created as torch's _init_group creates it."""
        state = self.optimizer.state[p]
        if not state:
            state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if self.fused
                             else torch.tensor(0.0, dtype=torch.float32))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _group_inputs(self, group: dict) -> dict:
        params = [p for p in group["params"] if p.grad is not None]
        states = [self._state(p) for p in params]
        inputs = {"params": [_local(p) for p in params], "grads": [_local(p.grad) for p in params],
                  "exp_avgs": [_local(s["exp_avg"]) for s in states],
                  "exp_avg_sqs": [_local(s["exp_avg_sq"]) for s in states], "steps": [s["step"] for s in states]}
        lr = group["lr"]
        if self.fused:
            inputs["lr"] = torch.tensor(float(lr), dtype=torch.float64)
            return inputs
        beta1, beta2 = group["betas"]
        counts = [float(s["step"] + 1) for s in states]  # the float32 counts the graph's increment makes
        # torch's expressions, in the same Python double
        scalars = [1 - lr * group["weight_decay"], *((1 - beta2 ** t) ** 0.5 for t in counts),
                   *((lr / (1 - beta1 ** t)) * -1 for t in counts)]
        inputs["scalars"] = torch.tensor(scalars, dtype=torch.float64)
        return inputs

    @torch.no_grad()
    def step(self) -> None:
        groups = self.optimizer.param_groups
        inputs = [self._group_inputs(group) for group in groups]
        found_inf = getattr(self.optimizer, "found_inf", None) if self.fused else None
        settings = tuple((*g["betas"], g["eps"], g["weight_decay"]) for g in groups)  # constants of the graph
        key = (tuple(len(i["params"]) for i in inputs), found_inf is None, settings)
        # what the lr scheduler's wrapper of optimizer.step() records (it warns of a schedule stepped first)
        self.optimizer._opt_called = True
        if key in self.graphs:
            self.graphs[key](inputs, found_inf)
            return

        def update(inputs, found_inf):
            for group_inputs, (beta1, beta2, eps, weight_decay) in zip(inputs, settings):
                if not group_inputs["params"]:
                    continue
                if self.fused:
                    _fused_update(**group_inputs, found_inf=found_inf, beta1=beta1, beta2=beta2, eps=eps,
                                  weight_decay=weight_decay)
                else:
                    _foreach_update(**group_inputs, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)

        gm = make_fx(update, tracing_mode="real")(inputs, found_inf)  # tracing runs this step's update
        if self.dump_folder is not None:
            write_graph(gm, self.dump_folder, tag=f"optimizer{len(self.graphs)}")
        self.graphs[key] = gm


def _fused_update(*, params, grads, exp_avgs, exp_avg_sqs, steps, lr, found_inf, beta1, beta2, eps, weight_decay):
    """torch.optim.adam._fused_adam's calls, lr as a tensor."""
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, found_inf=found_inf)
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))


def _foreach_update(*, params, grads, exp_avgs, exp_avg_sqs, steps, scalars, beta1, beta2, eps, weight_decay):
    """torch.optim.adam._multi_tensor_adam's (non-capturable) ops as its CPU path runs them, tensor by tensor;
    scalars: [1 - lr*wd, sqrt(bias_correction2) per tensor, -step_size per tensor]."""
    n = len(params)
    torch._foreach_add_(steps, 1)
    if weight_decay != 0:
        for p in params:
            p.mul_(scalars[0])
    for exp_avg, g in zip(exp_avgs, grads):
        exp_avg.lerp_(g, 1 - beta1)
    for exp_avg_sq in exp_avg_sqs:
        exp_avg_sq.mul_(beta2)
    for exp_avg_sq, g in zip(exp_avg_sqs, grads):
        exp_avg_sq.addcmul_(g, g, value=1 - beta2)
    denoms = [exp_avg_sq.sqrt() for exp_avg_sq in exp_avg_sqs]
    for i, denom in enumerate(denoms):
        denom.div_(scalars[1 + i])
        denom.add_(eps)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, scalars[1 + n:])

"""A lower bound on a rank's memory, checked against the device before anything is built: a seq_len or
batch_size whose activations cannot fit stops at config time with the estimate, instead of an
out-of-memory error (or the kernel's OOM killer, on a CPU) minutes into the run.

The bound counts only what a step must hold at once:
- activations: for each of this rank's layers and each token of a microbatch, the block input where the
  layer may be checkpointed (every layer under full checkpointing and remat, every `every`-th under
  selective layers), else at least the matmul outputs a SwiGLU block's backward needs (4 x dim for
  attention's q, attention output, output projection and FFN output, 2 x the FFN width for the gate and
  up projections), in the compute dtype; plus one layer's worth when any is checkpointed (its recompute);
- the loss chunk's fp32 logits and their gradient (chunk x vocab x 2);
- fp32 parameters, gradients and AdamW's two moments (16 bytes a parameter; 12 under bf16_params with
  optimizer.moment_dtype=bfloat16: bf16 weight and gradient, fp32 master, bf16 moments), split over the ranks;
- the global batch's token, label and document-id rows (int64), which every rank's loader builds.
Real use is higher (attention workspaces, allocator slack, communication buffers), so refusing above
the bound never refuses a run that would fit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import TrainConfig
from .mesh import Degrees
from .remat.peak import StaticMemory

GiB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    activations: int
    loss: int
    states: int
    data: int

    @property
    def total(self) -> int:
        return self.activations + self.loss + self.states + self.data


def estimate(config: TrainConfig, model_cfg, degrees: Degrees, *, device: torch.device,
             n_params: int) -> MemoryEstimate:
    t = config.training
    precision = t.mixed_precision if t.mixed_precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    value_bytes = 2 if precision in ("bf16", "bf16_params") else 4
    rows = t.batch_size // max(degrees.dp, 1) // t.grad_accum_steps
    if degrees.pp > 1:  # at least one microbatch of the pipeline's is in flight through this rank's stages
        rows = max(rows // max(config.parallelism.pp_microbatches, degrees.pp), 1)
    tokens = rows * t.seq_len // (degrees.cp * degrees.tp)  # sequence parallel splits what TP does not
    layers = -(-model_cfg.num_layers // degrees.pp)
    moe = getattr(model_cfg, "moe", None)
    ffn = moe.top_k * moe.expert_dim if moe is not None else getattr(model_cfg, "ffn_dim", 0)
    per_layer_token = 4 * model_cfg.dim + 2 * ffn
    checkpointed = checkpointed_layers(config, layers)
    recompute = per_layer_token if checkpointed else 0  # one checkpointed layer's, in its backward
    activations = tokens * (checkpointed * model_cfg.dim + (layers - checkpointed) * per_layer_token
                            + recompute) * value_bytes
    chunk = min(t.loss_chunk_size, tokens)
    loss = chunk * model_cfg.vocab_size * 4 * 2
    world = degrees.dp * degrees.cp * degrees.tp * degrees.pp
    states = state_bytes_per_param(config, device) * n_params // world
    data = 3 * t.batch_size * (t.seq_len + 1) * 8
    return MemoryEstimate(activations=activations, loss=loss, states=states, data=data)


def checkpointed_layers(config: TrainConfig, layers: int) -> int:
    """Of this rank's `layers`, those that may save only their input: all under full checkpointing and under
    remat (its planner may recompute every block, and picks what the budget keeps), every `every`-th from the
    first under selective layers (parallelize.py), none under selective ops or none."""
    ac = config.activation_checkpoint
    if ac.mode in ("full", "remat"):
        return layers
    if ac.mode == "selective" and ac.selective == "layers":
        return -(-layers // max(ac.every, 1))
    return 0


def state_bytes_per_param(config: TrainConfig, device: torch.device) -> int:
    """Weights, gradients and AdamW's moments a parameter holds: 16 bytes (fp32 everything, or bf16 weight and
    gradient with fp32 master and moments), 12 with optimizer.moment_dtype=bfloat16 under bf16_params."""
    bf16_moments = config.training.precision(device) == "bf16_params" and config.optimizer.moment_dtype == "bfloat16"
    return 12 if bf16_moments else 16


def gradient_bytes_per_param(config: TrainConfig, device: torch.device) -> int:
    """The gradient's share of state_bytes_per_param: 2 under bf16_params (the model's parameters, hence their
    gradients, are bf16), else 4 (fp32 parameters: fp32, and bf16 autocast or FSDP's bf16 policy, whose
    sharded gradients are reduced into fp32)."""
    return 2 if config.training.precision(device) == "bf16_params" else 4


def remat_static_memory(config: TrainConfig, model: torch.nn.Module, *, device: torch.device, shards: int,
                        tokens: int, autocast: bool) -> StaticMemory:
    """What the remat planner counts besides the saved activations of one microbatch of `tokens` (remat/peak.py):
    the state split into what the forward holds and the gradients (None through the forward unless
    training.grad_accum_steps > 1 keeps them across microbatches; the embedding's made last), and the fused
    loss's buffers (its chunk's logits apart: freed before the backward). Under autocast
    every block's bf16 weight copies are counted too (a kept block's products save them); a sharded model's
    gathered weights are not."""
    n = sum(p.numel() for p in model.parameters())
    grad_bytes = gradient_bytes_per_param(config, device)
    persist = config.training.grad_accum_steps > 1
    forward = (state_bytes_per_param(config, device) - (0 if persist else grad_bytes)) * n // shards
    if autocast:
        forward += 2 * sum(p.numel() for block in model.layers.values() for p in block.parameters())
    t, model_cfg = config.training, getattr(model, "config", None)
    vocab, dim = getattr(model_cfg, "vocab_size", 0), getattr(model_cfg, "dim", 0)
    act = 2 if config.training.precision(device) in ("bf16", "bf16_params") else 4
    sum_bytes = grad_bytes if t.loss_weight_grad_dtype == "param" else 4  # the output weight's gradient sum
    # a chunk's logits and gradient: the Triton kernel (CUDA, no vocabulary parallelism) writes the gradient
    # over the logits, act bytes an element; the torch paths' logits, fp32 work and gradient 8 at most
    triton = t.fused_kernels and device.type == "cuda" and config.parallelism.tp == 1
    chunk = min(t.loss_chunk_size, tokens) * vocab * (act if triton else 8)
    # then the [V, d] sum (and under autocast the weight's bf16 copy); the hidden states' cast and gradient,
    # the final norm's fp32 input and output
    loss = chunk + vocab * dim * (sum_bytes + (2 if autocast else 0)) + tokens * dim * (2 * act + 8)
    return StaticMemory(forward_bytes=forward, gradient_bytes=grad_bytes * n // shards, gradients_persist=persist,
                        loss_bytes=loss, loss_chunk_bytes=chunk,
                        late_gradient_bytes=grad_bytes * _embedding_parameters(model) // shards)


def _embedding_parameters(model: torch.nn.Module) -> int:
    """Parameters whose gradients the backward makes after every block's: the embedding's (and its norm's),
    unless tied to the output head, whose gradient comes first."""
    head = {id(p) for p in model.output.parameters()} if getattr(model, "output", None) is not None else set()
    modules = [getattr(model, name, None) for name in ("tok_embeddings", "embedding_norm")]
    return sum(p.numel() for m in modules if m is not None for p in m.parameters() if id(p) not in head)


def available_bytes(device: torch.device) -> int | None:
    """Free memory of the device (CUDA: mem_get_info; CPU: MemAvailable from /proc/meminfo); None when
    it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory_fits(config: TrainConfig, model_cfg, degrees: Degrees, *, device: torch.device,
                      n_params: int) -> None:
    """ValueError with the estimate when its lower bound exceeds the device's free memory."""
    free = available_bytes(device)
    if free is None:
        return
    need = estimate(config, model_cfg, degrees, device=device, n_params=n_params)
    if need.total <= free:
        return
    t = config.training
    hint = "" if checkpointed_layers(config, 2) == 2 else ", or set activation_checkpoint.mode=full"
    raise ValueError(
        f"training.seq_len={t.seq_len} x training.batch_size={t.batch_size} cannot fit: each rank needs at least "
        f"{need.total / GiB:.1f} GiB (activations {need.activations / GiB:.1f}, loss chunk {need.loss / GiB:.1f}, "
        f"parameters + gradients + AdamW moments {need.states / GiB:.1f}, batch rows {need.data / GiB:.1f}) but "
        f"{device.type} has {free / GiB:.1f} GiB free; lower training.batch_size or training.seq_len, raise "
        f"training.grad_accum_steps or the parallel degrees{hint}")

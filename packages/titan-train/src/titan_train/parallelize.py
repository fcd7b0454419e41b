"""Parallelism applied from outside the model: tensor + sequence parallel from the model's declared plan,
activation checkpointing, and FSDP/HSDP (torch's fully_shard).

Order matters and follows what each wrapper expects to find: TP turns parameters into DTensors on the
tp mesh, checkpointing and compile wrap each block, and fully_shard goes last so it shards the
(possibly TP-sharded) parameters over the data-parallel mesh and sees compiled blocks.
"""
from __future__ import annotations

import fnmatch
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from .config import ActivationCheckpointConfig
from .remat.wrap import checkpoint_whole


def matching_modules(model: nn.Module, pattern: str) -> list[str]:
    """Module paths of `model` matching `pattern` (`*` stands for one path component)."""
    depth = pattern.count(".")
    return [name for name, _ in model.named_modules()
            if name.count(".") == depth and fnmatch.fnmatchcase(name, pattern)]


def tensor_parallel_styles(model: nn.Module) -> dict[str, str]:
    """Module path -> the style name (colwise, rowwise, ...) `model.parallel_plan` gives it under TP."""
    styles: dict[str, str] = {}
    for pattern, style in model.parallel_plan.tensor_parallel.items():
        for name in matching_modules(model, pattern):
            styles.setdefault(name, style)
    return styles


def _tp_style(style: str, pattern: str) -> ParallelStyle:
    """The torch ParallelStyle for one of titan-models' TP_STYLES (residual stream sharded on the sequence).

    "output" is colwise over the vocabulary: the output weight is Shard(0) over the tp ranks. Pretraining
    never runs its forward (CausalLMLoss reads the weight into its vocabulary-parallel fused loss); the RL
    update's does (tensor_parallel_logprobs). Its input is the sequence-sharded residual stream, declared
    Shard(1) so that it is all-gathered to [b, s, d] (reduce-scattered in backward) before the linear, which
    gives vocabulary-sharded logits: a Shard(1) DTensor handed to F.linear as is relies on the linear's
    sharding propagation, which torch 2.11 lacks ("Attempted to flatten multiple dimensions, with dimension
    1 being sharded").
    """
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=Shard(1))
    if style == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if style == "sequence_parallel":
        return SequenceParallel()
    if style == "output":
        return ColwiseParallel(input_layouts=Shard(1), use_local_output=False)
    raise ValueError(f"tensor-parallel style {style!r} of {pattern!r} is not supported by this trainer yet "
                     "(supported: colwise, rowwise, embedding, output, sequence_parallel, replicate, headwise)")


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the group (a replicated weight each rank
    applied to its own heads or tokens only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _compute_on_local_values(module: nn.Module, tp_mesh: DeviceMesh, placement, *, sum_gradient: bool = True) -> None:
    """"replicate" (placement Replicate) and "headwise" (Shard(0)): the module's own parameters become
    DTensors with that placement (what checkpoints and FSDP see), while its forward, which also gets
    this rank's local activations (heads from colwise projections), computes with their local values:
    a pre-hook puts `param.to_local()` in each parameter's place and a post-hook puts the parameters
    back. Gradients flow into the DTensors; a replicated weight's is summed over the TP ranks. An input
    that arrives as a DTensor (DeepSeek-V3's MTP projection of two sequence-parallel norms' outputs) is
    taken as this rank's local values too, as every other input is."""
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, tp_mesh, [placement]),
                                                     requires_grad=param.requires_grad))
    parameters: dict[str, nn.Parameter] = {}

    def swap_in(mod, args):
        for name, param in list(mod._parameters.items()):
            if isinstance(param, DTensor):
                parameters[name] = param
                local = param.to_local()
                # replicate_whole (sum_gradient False): applied to what every rank holds whole, its gradient is
                # already the whole one on each rank
                mod._parameters[name] = (_SumGradient.apply(local, tp_mesh.get_group())
                                         if isinstance(placement, Replicate) and sum_gradient else local)
        return tuple(x.to_local(grad_placements=x.placements) if isinstance(x, DTensor) else x for x in args)

    def swap_out(mod, args, output):
        mod._parameters.update(parameters)
        parameters.clear()

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_out)


def _gather_sequence_hook(tp_mesh: DeviceMesh):
    """Forward pre-hook of a module whose projections are colwise: all-gather its first input from
    sequence-sharded [b, s / tp, d] to whole [b, s, d] (reduce-scatter in backward)."""
    def hook(module, args, kwargs):
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, tp_mesh, (Shard(1),), run_check=False)
        x = x.redistribute(tp_mesh, (Replicate(),)).to_local()
        return (x, *args[1:]), kwargs
    return hook


def _sum_shared_key_rope_gradient(wkv_a: nn.Linear, kv_lora_rank: int, tp_mesh: DeviceMesh) -> None:
    """MLA under TP: wkv_a (replicate_whole) maps the gathered sequence to [latent | shared rope key]. The
    latent feeds the colwise wkv_b, whose input gradient comes back summed over tp, but the rope key joins
    this rank's heads directly, so its gradient holds those heads' share only: sum it over tp, making the
    whole output's gradient the same on every rank (and wkv_a's own gradient whole, as replicate_whole says)."""
    group = tp_mesh.get_group()

    def hook(module, args, out):
        latent, rope_key = out.split([kv_lora_rank, out.shape[-1] - kv_lora_rank], dim=-1)
        return torch.cat([latent, _SumGradient.apply(rope_key, group)], dim=-1)
    wkv_a.register_forward_hook(hook)


def local_sequence_hooks(module: nn.Module) -> None:
    """The module takes this rank's sequence shard as a plain tensor (a sequence-parallel norm hands it a
    DTensor) and returns a plain tensor, as the rowwise projections of the other blocks do."""
    def to_local(mod, args):
        x = args[0]
        return (x.to_local(grad_placements=x.placements) if isinstance(x, DTensor) else x, *args[1:])
    module.register_forward_pre_hook(to_local)


def check_tp_divisibility(model: nn.Module, tp: int, seq_len: int) -> None:
    config = model.config  # a titan_models.ModelConfig
    model.parallel_plan.check_tensor_parallel(tp)  # the head counts the family declares (linear attention too)
    for name, value in (("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
                        ("ffn_dim", config.ffn_dim)):
        if value % tp:
            raise ValueError(f"parallelism.tp={tp} does not divide the model's {name}={value}")
    if seq_len % tp:
        raise ValueError(f"parallelism.tp={tp} does not divide training.seq_len={seq_len} (sequence parallel)")
    if config.tie_embeddings:
        raise ValueError("tensor parallelism with tied embeddings is not supported yet: the embedding is "
                         "vocab-sharded while the output weight stays whole; use an untied flavor or tp=1")


def check_moe_under_tp(model: nn.Module, *, tp: int, ep: int) -> None:
    """Tensor parallelism does not split routed experts: each tp rank routes its own sequence shard to the
    experts of its ep group (ExpertParallel), so a MoE model (DeepSeek-V3's MTP block included) needs ep > 1."""
    if tp > 1 and ep == 1 and any(matching_modules(model, pattern) for pattern in model.parallel_plan.moe):
        raise ValueError(f"parallelism.tp={tp} on a MoE model needs parallelism.ep > 1 (the routed experts are not "
                         "TP-split: each tp rank routes its own sequence shard over the ep group); e.g. "
                         "--parallelism.ep 2 with parallelism.dp_shard a multiple of 2")


def _check_vocab_divisible(model: nn.Module, names: list[str], tp: int) -> None:
    for name in names:
        vocab = model.get_submodule(name).weight.shape[0]
        if vocab % tp:
            raise ValueError(f"parallelism.tp={tp} does not divide the vocabulary ({vocab}) that the "
                             f"vocabulary-parallel loss shards {name} over; set model.vocab_size to a multiple of tp")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_local: tuple[str, ...] = ()) -> None:
    """Shard `model` over `tp_mesh` following `model.parallel_plan.tensor_parallel`.

    sequence_local: module names (the MoE layers under expert parallelism) left out of the plan: each tp
    rank runs them whole on its own sequence shard [b, s / tp, d] (local_sequence_hooks), and the caller
    sums their parameters' gradients over the tp ranks."""
    plan: dict[str, ParallelStyle] = {}
    gathered_parents: set[str] = set()
    inside = lambda name: any(name == m or name.startswith(m + ".") for m in sequence_local)  # noqa: E731
    for module_name in sequence_local:
        local_sequence_hooks(model.get_submodule(module_name))
    for pattern, style_name in model.parallel_plan.tensor_parallel.items():
        names = [n for n in matching_modules(model, pattern) if not inside(n)]
        if not names:
            continue  # e.g. `output` removed from a pipeline stage
        if style_name in ("replicate", "headwise", "replicate_whole"):
            for name in names:
                _compute_on_local_values(model.get_submodule(name), tp_mesh,
                                         Shard(0) if style_name == "headwise" else Replicate(),
                                         sum_gradient=style_name == "replicate")
            continue
        style = _tp_style(style_name, pattern)
        if style_name == "output":
            _check_vocab_divisible(model, names, tp_mesh.size())
        for name in names:
            plan[name] = style
            if style_name == "colwise":
                gathered_parents.add(name.rpartition(".")[0])
    parallelize_module(model, tp_mesh, plan)
    for parent in sorted(gathered_parents):
        model.get_submodule(parent).register_forward_pre_hook(_gather_sequence_hook(tp_mesh), with_kwargs=True)
    for module in model.modules():
        if hasattr(getattr(module, "config", None), "kv_lora_rank") and isinstance(getattr(module, "wkv_a", None),
                                                                                    nn.Linear):
            _sum_shared_key_rope_gradient(module.wkv_a, module.config.kv_lora_rank, tp_mesh)
    leftovers = [n for n, p in model.named_parameters()
                 if not isinstance(p, DTensor) and not inside(n.rpartition(".")[0])]
    if leftovers:
        raise ValueError(f"the model's parallel plan leaves parameters without a tensor-parallel style: "
                         f"{', '.join(leftovers[:5])}")


def _op_sac_policy():
    """Selective checkpointing at op level: keep matmul and attention outputs (fp8 GEMMs included; expensive to
    recompute), recompute the cheap elementwise ops between them (norms, activations, RoPE)."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_mm")
    save = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    # quantize.linear's GEMMs, custom ops (quantize/gemm.py): registered when their modules are imported
    from .quantize import blockwise_triton, gemm  # noqa: F401

    save |= {getattr(torch.ops.titan_train, n).default
             for n in ("fp8_scaled_mm", "mx_dequantized_mm", "fp8_blockwise_gemm")}

    def policy(ctx, op, *args, **kwargs):
        if op in save or "flex_attention" in str(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def apply_activation_checkpointing(model: nn.Module, config: ActivationCheckpointConfig) -> None:
    if config.mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if config.every < 1:
        raise ValueError(f"activation_checkpoint.every must be >= 1, got {config.every}")
    for index, (name, block) in enumerate(list(model.layers.items())):
        if config.mode == "full":
            wrapped = checkpoint_whole(block)
        elif config.selective == "layers":
            if index % config.every:
                continue
            wrapped = checkpoint_whole(block)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False,
                                         context_fn=partial(create_selective_checkpoint_contexts, _op_sac_policy()))
        model.layers[name] = wrapped


def keep_activations_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Make the embedding output (and so the residual stream) `dtype` under autocast, as FSDP's bf16 policy
    does: autocast alone keeps the fp32 master embedding's output, and every norm and residual add then
    moves twice the bytes. Matmuls see the same bf16 inputs either way."""
    if getattr(model, "tok_embeddings", None) is not None:
        model.tok_embeddings.register_forward_hook(lambda module, args, out: out.to(dtype))


def apply_fsdp(root: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, *, param_dtype: torch.dtype | None,
               reshard_after_forward: bool) -> None:
    """fully_shard each block, then `root` (the loss wrapper, or a pipeline stage) for what is left
    (embeddings, final norm, output): the root's forward is what FSDP's hooks see. param_dtype=bf16 gives
    bf16 compute with fp32 master weights and fp32 gradient reduction."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again first in backward: keep them gathered.
        fully_shard(block, mesh=dp_mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(root, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)

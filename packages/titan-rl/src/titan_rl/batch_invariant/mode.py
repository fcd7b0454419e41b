"""`batch_invariant(model)`: make a titan-models model compute with the batch-invariant ops.

Uses titan-models' `override` on each module it replaces (Linear, RMSNorm, FeedForward, the inner
attention), so parameter names and shapes are checked to be unchanged and the model definition is
not forked. Logprobs from such a model should be taken with `titan_rl.token_logprobs`, which then
uses the batch-invariant log-softmax as well.
"""
from __future__ import annotations

import titan_models as tm
from torch import nn
from titan_models.components.ffn import FeedForward
from titan_models.components.gated_deltanet import GatedDeltaNet
from titan_models.components.moe import MoE
from titan_models.components.norms import InputScaledRMSNorm, RMSNorm, ScalelessRMSNorm, ZeroCenteredRMSNorm

from titan_rl.batch_invariant.moe import BatchInvariantMoE, unsupported_features
from titan_rl.batch_invariant.modules import (
    BatchInvariantAttention, BatchInvariantFeedForward, BatchInvariantLinear, BatchInvariantRMSNorm,
)


def is_batch_invariant(model: nn.Module) -> bool:
    return getattr(model, "_titan_rl_batch_invariant", False)


def batch_invariant(model: nn.Module) -> nn.Module:
    """Switch `model` (in place) to batch-invariant computation and return it. Idempotent.

    Raises ValueError for models with LayerNorm, linear attention or MoE features without a
    batch-invariant form (see BatchInvariantMoE).
    """
    if is_batch_invariant(model):
        return model
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError(f"batch_invariant() expects a titan-models Transformer (with .layers); got {type(model).__name__}")
    names = dict(model.named_modules())
    unsupported = sorted(n for n, m in names.items() if isinstance(m, nn.LayerNorm))
    if unsupported:
        raise ValueError(f"batch_invariant() supports RMSNorm models; found LayerNorm modules {unsupported[:4]}")
    linear = sorted(n for n, m in names.items() if isinstance(m, GatedDeltaNet))
    if linear:
        raise ValueError("batch_invariant() does not support linear-attention models (Gated DeltaNet, zero-centred "
                         f"norms: no fixed-order kernels yet); found {linear[:4]}")
    norms = sorted(n for n, m in names.items()
                   if isinstance(m, (ZeroCenteredRMSNorm, ScalelessRMSNorm, InputScaledRMSNorm)))
    if norms:
        # Muse Glimmer / Spark: besides these norms, the attention's sigmoid output gate and the tanh soft-cap are
        # inline torch calls this mode cannot swap (elementwise kernels may round vector tails by batch shape)
        raise ValueError("batch_invariant() has no fixed-order kernels for zero-centred, scaleless or input-scaled "
                         "norms, nor for the inline sigmoid output gate and tanh soft-cap beside them (Muse "
                         f"Glimmer / Spark); found {norms[:4]}")
    moe = {n: unsupported_features(m.config) for n, m in names.items() if isinstance(m, MoE)}
    moe = {n: features for n, features in moe.items() if features}
    if moe:
        name, features = next(iter(moe.items()))
        raise ValueError(f"batch_invariant() does not provide these MoE features of {name}: {', '.join(features)}; "
                         "supported: softmax, sigmoid and top-k-softmax routing, expert groups, shared experts")
    # Order matters: MoE layers first (they keep their router, experts and shared experts), then
    # FeedForward (it takes over its own w1/w2/w3), then the remaining modules.
    for name, module in names.items():
        if isinstance(module, MoE):
            tm.override(model, name, lambda _, old: BatchInvariantMoE(old))
    for name, module in dict(model.named_modules()).items():
        if isinstance(module, FeedForward):
            tm.override(model, name, lambda _, old: BatchInvariantFeedForward(old))
    for name, module in dict(model.named_modules()).items():
        if isinstance(module, RMSNorm):
            tm.override(model, name, lambda _, old: BatchInvariantRMSNorm(old))
        elif isinstance(module, nn.Linear):
            tm.override(model, name, lambda _, old: BatchInvariantLinear(old))
        elif name.endswith(".attention.inner"):
            tm.override(model, name, lambda _, old: _invariant_inner(old))
    model._titan_rl_batch_invariant = True
    return model


def _invariant_inner(old: nn.Module) -> nn.Module:
    # A generator may have wrapped the inner attention already: swap what it wraps.
    wrapped = getattr(old, "base", None)
    if wrapped is not None and hasattr(old, "replace_base"):
        return old.replace_base(BatchInvariantAttention(scale=wrapped.scale,
                                                        sliding_window=getattr(wrapped, "sliding_window", None)))
    return BatchInvariantAttention(scale=old.scale, sliding_window=getattr(old, "sliding_window", None))

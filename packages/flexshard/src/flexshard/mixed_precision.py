"""Mixed-precision policy: compute dtype of the gathered parameters, reduction dtype of gradients."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """`param_dtype`: dtype parameters are all-gathered and computed in (None: their own dtype).
    `reduce_dtype`: dtype gradients are reduce-scattered in (None: the gradient's dtype). The default
    fp32 keeps the sum exact-ish with bf16 compute; the sharded parameters and gradients stay in the
    parameters' own (master) dtype.
    `output_dtype`: cast floating outputs of each sharded module to it (None: leave them).
    `cast_forward_inputs`: cast floating inputs of each sharded module to `param_dtype`.

    torch's `MixedPrecisionPolicy` is accepted too, with its meaning (its `reduce_dtype=None` means
    `param_dtype`), so a `fully_shard` call can be swapped for `flexshard.shard` unchanged.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @staticmethod
    def coerce(policy: Any) -> "MixedPrecision":
        if policy is None:
            return MixedPrecision(reduce_dtype=None)
        if isinstance(policy, MixedPrecision):
            return policy
        fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
        if all(hasattr(policy, f) for f in fields):  # torch.distributed.fsdp.MixedPrecisionPolicy
            return MixedPrecision(
                param_dtype=policy.param_dtype,
                reduce_dtype=policy.reduce_dtype or policy.param_dtype,
                output_dtype=policy.output_dtype,
                cast_forward_inputs=policy.cast_forward_inputs,
            )
        raise TypeError(
            f"mp_policy must be flexshard.MixedPrecision, torch's MixedPrecisionPolicy or None, got {type(policy).__name__}"
        )


def cast_floating(dtype: torch.dtype, tree: Any) -> Any:
    """Cast every floating tensor in a pytree to `dtype`."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x

    return pytree.tree_map(cast, tree)

"""Which titan models the vLLM adapter can serve, and why not the others (no vLLM import here).

The adapter (titan_rl.vllm.model) runs our modules inside vLLM and hands each attention's q/k/v to a
vLLM `Attention` layer, which owns the paged KV cache, with the layer's sliding window and sinks (vLLM's
CPU attention runs both). That is the only per-sequence state vLLM keeps for it. Linear-attention layers
(Gated DeltaNet in Qwen3.5 / Qwen3-Next, Kimi Delta Attention in Kimi Linear) carry a short-conv history
and a delta-rule state per sequence across steps; vLLM keeps such state only for models written to its
hybrid interface (an `IsHybrid` model whose mixer layers are `MambaBase` layers with their own state-cache
specs and the gdn/mamba attention metadata), which the adapter does not implement: those families are
refused here, before an engine starts, and run with titan-rl's built-in generator, which carries the
state (`AttentionContext.recurrent_states`).
"""
from __future__ import annotations

import titan_models as tm
from torch import nn

LINEAR_ATTENTION = (
    "has linear-attention layers ({layers}), whose short-conv history and delta-rule state vLLM keeps only "
    "for models written to its hybrid interface (IsHybrid with MambaBase mixer layers owning a state cache); "
    "the titan vLLM adapter routes only attention's KV cache through vLLM, so it cannot serve this model. "
    "Generate with titan_rl.BuiltinGenerator, which carries that state")


def unservable_reason(model: nn.Module, *, batch_invariant: bool = False) -> str | None:
    """Why the vLLM adapter cannot serve `model` (a titan-models Transformer), or None if it can."""
    from titan_models.components.gated_deltanet import GatedDeltaNet

    linear = sorted({type(m).__name__ for m in model.modules() if isinstance(m, GatedDeltaNet)})
    if linear:
        return LINEAR_ATTENTION.format(layers=", ".join(linear))
    family = tm.family_of(model.config)
    if not family.vllm_architectures:
        served = sorted(f.name for f in tm.families() if f.vllm_architectures)
        return (f"family {family.name!r} declares no vLLM architecture (Family.vllm_architectures); "
                f"families the adapter serves: {served}")
    if batch_invariant and any(getattr(m, "sinks", None) is not None or getattr(m, "sliding_window", None)
                               for m in model.modules()):
        return ("batch-invariant mode's attention backend has no attention sinks or sliding windows; "
                "run with batch_invariant=False (vLLM's own CPU attention runs them)")
    return None


def check_servable(model: nn.Module, *, batch_invariant: bool = False) -> None:
    """ValueError saying why, when the vLLM adapter cannot serve `model`."""
    reason = unservable_reason(model, batch_invariant=batch_invariant)
    if reason is not None:
        raise ValueError(f"{type(model.config).__name__}: {reason}")

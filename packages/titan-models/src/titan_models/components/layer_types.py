"""Per-layer schedules of token mixers (`layer_types`), as hybrid models (Qwen3-Next, Qwen3.5) declare them."""
from __future__ import annotations

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


def every_nth_full(num_layers: int, interval: int) -> tuple[str, ...]:
    """Layer i is full attention when (i + 1) is a multiple of `interval`, else linear attention
    (Hugging Face's `full_attention_interval` default: 3 linear then 1 full for interval 4)."""
    if interval < 1:
        raise ValueError(f"full_attention_interval must be >= 1, got {interval}")
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


def check_layer_types(layer_types: tuple[str, ...] | list[str], *, num_layers: int, allowed: tuple[str, ...],
                      field: str = "layer_types") -> tuple[str, ...]:
    """`layer_types` as a tuple; ValueError naming `field` for a wrong length or an unknown entry."""
    layer_types = tuple(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(f"{field} has {len(layer_types)} entries but the model has {num_layers} layers")
    unknown = sorted({t for t in layer_types if t not in allowed})
    if unknown:
        raise ValueError(f"{field} has unknown entries {unknown}; allowed: {list(allowed)}")
    return layer_types

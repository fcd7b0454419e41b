"""RoPE settings in Hugging Face config.json, in both spellings transformers has used:
`rope_theta` + `rope_scaling` (4.x and most published checkpoints) and `rope_parameters` (5.x)."""
from __future__ import annotations

from typing import Any

from titan_models.components.rope import Llama3RopeScaling, RopeScaling, YarnRopeScaling


def read_rope(hf: dict[str, Any], *, allowed: tuple[str, ...]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from a config dict; ValueError for a rope type outside `allowed`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default",) + allowed:
        raise ValueError(f"config.json field rope type {rope_type!r} is not supported here; supported: "
                         f"{('default',) + allowed}")
    original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if rope_type == "llama3":
        return float(theta), Llama3RopeScaling(
            factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]), original_max_seq_len=int(original))
    if rope_type == "yarn":
        factor = params.get("factor")
        if factor is None:
            factor = hf["max_position_embeddings"] / original
        return float(theta), YarnRopeScaling(
            factor=float(factor), original_max_seq_len=int(original),
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            truncate=bool(params.get("truncate", True)),
            explicit_attention_factor=params.get("attention_factor"))
    return float(theta), None


def write_rope(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """Both spellings, so transformers 4.x and 5.x (and vLLM) read the same settings."""
    if scaling is None:
        params: dict[str, Any] = {"rope_type": "default"}
    elif isinstance(scaling, Llama3RopeScaling):
        params = {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
                  "high_freq_factor": scaling.high_freq_factor,
                  "original_max_position_embeddings": scaling.original_max_seq_len}
    else:
        params = {"rope_type": "yarn", "factor": scaling.factor,
                  "original_max_position_embeddings": scaling.original_max_seq_len,
                  "beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow, "mscale": scaling.mscale,
                  "mscale_all_dim": scaling.mscale_all_dim}
        if not scaling.truncate:
            params["truncate"] = False
        if scaling.explicit_attention_factor is not None:
            params["attention_factor"] = scaling.explicit_attention_factor
    legacy = None if scaling is None else dict(params)
    return {"rope_theta": theta, "rope_scaling": legacy, "rope_parameters": {**params, "rope_theta": theta}}

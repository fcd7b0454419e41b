"""Building the model from the config: flavor + transforms, on meta, parallelized, then materialized."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import titan_models as tm
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from .config import ModelConfig


def model_config(config: ModelConfig, *, vocab_needed: int):
    """The titan-models config of `config` (a flavor with the requested transforms)."""
    try:
        model_cfg = tm.flavor(config.family, config.flavor)
    except (KeyError, ValueError) as e:
        raise ValueError(f"model.family/model.flavor: {e}") from None
    transforms = []
    if config.num_layers:
        transforms.append(tm.transforms.num_layers(config.num_layers))
    if config.attention != "default":
        transforms.append(tm.transforms.attention(config.attention))
    if transforms:
        model_cfg = tm.transforms.compose(*transforms)(model_cfg)
    if config.vocab_size:
        model_cfg = dataclasses.replace(model_cfg, vocab_size=config.vocab_size)
    if model_cfg.vocab_size < vocab_needed:
        raise ValueError(f"the tokenizer needs a vocabulary of {vocab_needed}, but {config.family} {config.flavor} "
                         f"has vocab_size {model_cfg.vocab_size}")
    return model_cfg


def build_on_meta(model_cfg) -> nn.Module:
    with torch.device("meta"):
        return model_cfg.build()


def materialize(model: nn.Module, model_cfg, *, device: torch.device, seed: int, distributed: bool) -> None:
    """Give the (meta, possibly parallelized) model real weights that do not depend on the layout.

    One process: allocate and init_weights in place. Several: rank 0 builds the whole model on its CPU,
    initialises it with the same seed, and every rank copies out its shard (set_model_state_dict with
    broadcast_from_rank0), so FSDP/TP runs start from the bit-identical weights of a single-process run.
    """
    model.to_empty(device=device)
    if not distributed:
        model.init_weights(seed=seed)
        return
    full: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        reference = build_on_meta(model_cfg).to_empty(device="cpu")  # skips nn.Linear's own (wasted) init
        reference.init_weights(seed=seed)
        full = reference.state_dict()
    # Buffers (RoPE frequencies) are not in the broadcast: every rank recomputes them.
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if reset is not None:
            reset()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


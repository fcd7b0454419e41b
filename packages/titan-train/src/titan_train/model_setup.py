"""Building the model from the config: flavor + transforms, on meta, parallelized, then materialized."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

import titan_models as tm

from .config import ModelConfig
from .sharding_impl import load_full_state


def model_config(config: ModelConfig, *, vocab_needed: int):
    """The titan-models config of `config` (a flavor, or a Hugging Face folder's architecture, with the
    requested transforms)."""
    if config.hf_path:
        try:
            model_cfg = tm.hf.read_config(config.hf_path)
        except (OSError, ValueError) as e:
            raise ValueError(f"model.hf_path: {e}") from None
        model_cfg = dataclasses.replace(model_cfg, dtype=torch.float32)  # master weights are fp32
    else:
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
    if config.vocab_size and not config.hf_path:
        model_cfg = dataclasses.replace(model_cfg, vocab_size=config.vocab_size)
    model_cfg = _with_mtp(model_cfg, config)
    if model_cfg.vocab_size < vocab_needed:
        raise ValueError(f"the tokenizer needs a vocabulary of {vocab_needed}, but {config.family} {config.flavor} "
                         f"has vocab_size {model_cfg.vocab_size}")
    return model_cfg


def _with_mtp(model_cfg, config: ModelConfig):
    """The config with model.mtp_layers multi-token-prediction modules (a family that has them: `mtp`)."""
    if config.mtp_layers < 0:
        raise ValueError(f"model.mtp_layers must be >= 0, got {config.mtp_layers}")
    if not hasattr(model_cfg, "mtp"):
        if config.mtp_layers:
            raise ValueError(f"model.mtp_layers={config.mtp_layers}: the {model_cfg.family} family has no "
                             "multi-token-prediction module (deepseek_v3 has)")
        return model_cfg
    if config.mtp_layers > 1:
        raise ValueError(f"model.mtp_layers={config.mtp_layers}: titan-models builds one MTP module "
                         "(depth 1, as DeepSeek-V3 trains); allowed: 0, 1")
    # A flavor or Hugging Face folder that has an MTP module keeps it only when it is trained.
    return dataclasses.replace(model_cfg, mtp=config.mtp_layers == 1)


def build_on_meta(model_cfg) -> nn.Module:
    with torch.device("meta"):
        return model_cfg.build()


def initial_state(model_cfg, *, seed: int, hf_path: str, adapters=None) -> dict[str, torch.Tensor]:
    """The full initial weights on CPU: init_weights(seed), or a Hugging Face folder's tensors; with
    `adapters` (lora.LoRA) their initial values too."""
    if hf_path:
        reference = tm.from_hf(hf_path, dtype=model_cfg.dtype)
    else:
        reference = build_on_meta(model_cfg).to_empty(device="cpu")  # skips nn.Linear's own (wasted) init
        reference.init_weights(seed=seed)
    if adapters is not None:
        adapters.apply(reference)
        adapters.reset(reference)
    state = reference.state_dict()
    if hf_path and not getattr(model_cfg, "mtp", False):  # the folder's MTP module, not trained (model.mtp_layers 0)
        state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    return state


def materialize(model: nn.Module, model_cfg, *, device: torch.device, seed: int, distributed: bool,
                hf_path: str = "", adapters=None) -> None:
    """Give the (meta, possibly parallelized) model real weights that do not depend on the layout.

    One process: allocate and init_weights in place (or copy a Hugging Face folder's weights in). Several:
    rank 0 builds the whole model on its CPU, initialises it the same way, and every rank copies out its
    shard (set_model_state_dict with broadcast_from_rank0), so FSDP/TP runs start from the bit-identical
    weights of a single-process run.
    """
    model.to_empty(device=device)
    if not distributed:
        if hf_path:
            model.init_buffers()
            model.load_state_dict(initial_state(model_cfg, seed=seed, hf_path=hf_path, adapters=adapters))
        else:
            model.init_weights(seed=seed)
            if adapters is not None:
                adapters.reset(model)
        return
    full: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        full = initial_state(model_cfg, seed=seed, hf_path=hf_path, adapters=adapters)
    model.init_buffers()  # buffers (RoPE frequencies) are not in the broadcast: every rank recomputes them
    load_full_state(model, full)  # set_model_state_dict(broadcast_from_rank0), or piecewise for flexshard


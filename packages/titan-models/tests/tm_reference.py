"""Test helpers: tiny random Hugging Face models as the independent numeric reference."""
from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over the whole tensor."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def build(config, *, seed: int = 0):
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def save_hf(hf_config, folder, *, seed: int = 0, auto_class: str = "AutoModelForCausalLM", prepare=None,
            **save_kwargs):
    """A randomly initialised transformers model saved to `folder`; returns the model (eval, float32).

    Norm weights are randomised too (HF initialises them to one, which would hide a swapped norm);
    `prepare(model)` then adjusts what a family's test case needs.
    """
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, auto_class).from_config(hf_config, attn_implementation="eager",
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.05)
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.uniform_(-0.05, 0.05)
    if prepare is not None:
        prepare(model)
    model.save_pretrained(folder, **save_kwargs)
    return model


def load_hf(folder, *, auto_class: str = "AutoModelForCausalLM"):
    import transformers

    return getattr(transformers, auto_class).from_pretrained(folder, attn_implementation="eager",
                                                             dtype=torch.float32).eval()

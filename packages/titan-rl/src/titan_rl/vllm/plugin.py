"""The `vllm.general_plugins` entry point: registers titan-models architectures with vLLM."""
from __future__ import annotations

from collections.abc import Mapping


def architectures() -> Mapping[str, str]:
    """Our vLLM architecture name -> the Hugging Face architecture whose config and weights it reads, for
    every titan-models family that declares one (`Family.vllm_architectures`)."""
    import titan_models as tm

    return tm.registry.vllm_architectures()


def register() -> None:
    """Called by vLLM in every process it starts (engine, workers); idempotent."""
    from vllm import ModelRegistry

    for name in architectures():
        if name not in ModelRegistry.get_supported_archs():
            # A "module:Class" string: vLLM imports the model lazily, in the process that builds it.
            ModelRegistry.register_model(name, "titan_rl.vllm.model:TitanForCausalLM")

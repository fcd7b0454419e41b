"""The `vllm.general_plugins` entry point: registers titan-models architectures with vLLM."""
from __future__ import annotations

# Our architecture name -> the Hugging Face architecture whose config and weights it reads.
ARCHITECTURES = {
    "TitanLlamaForCausalLM": "LlamaForCausalLM",
    "TitanQwen3ForCausalLM": "Qwen3ForCausalLM",
}


def register() -> None:
    """Called by vLLM in every process it starts (engine, workers); idempotent."""
    from vllm import ModelRegistry

    for name in ARCHITECTURES:
        if name not in ModelRegistry.get_supported_archs():
            # A "module:Class" string: vLLM imports the model lazily, in the process that builds it.
            ModelRegistry.register_model(name, "titan_rl.vllm.model:TitanForCausalLM")

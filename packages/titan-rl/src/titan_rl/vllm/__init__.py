"""titan-models definitions inside vLLM (the `vllm` extra).

Installing titan-rl registers the plugin through the `vllm.general_plugins` entry point: vLLM then
knows the architectures in `architectures()` ("TitanLlamaForCausalLM", ...). Point vLLM at a Hugging
Face folder (e.g. written by `titan_models.to_hf`) and route it to our definition with
`hf_overrides={"architectures": ["TitanLlamaForCausalLM"]}`; `VLLMGenerator` does this for you.
Importing this package does not import vLLM; `titan_rl.vllm.generator` and `.model` do.
"""
from titan_rl.vllm.plugin import architectures, register

__all__ = ["architectures", "register"]

"""Qwen3 dense and MoE: the family's config, flavors and Hugging Face converter, registered once."""
from titan_models.models.qwen3.flavors import FLAVORS, PUBLISHED_PARAMS
from titan_models.models.qwen3.hf import TINY_HF_CONFIGS, Qwen3Converter
from titan_models.models.qwen3.model import Qwen3Config
from titan_models.registry import Family, register

# vLLM runs the dense models only (the adapter gives each layer a vLLM Attention; MoE stays ours).
FAMILY = register(Family(
    name="qwen3", config_type=Qwen3Config, flavors=FLAVORS, published_sizes=PUBLISHED_PARAMS,
    hf=Qwen3Converter(), vllm_architectures={"TitanQwen3ForCausalLM": "Qwen3ForCausalLM"},
    tiny_hf_configs=TINY_HF_CONFIGS))

__all__ = ["FAMILY", "FLAVORS", "Qwen3Config", "Qwen3Converter"]

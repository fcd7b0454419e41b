"""Shared model definitions (Llama 3, Qwen3 dense and MoE, DeepSeek-V3), typed configs and Hugging Face weight interop."""

__version__ = "0.1.0"

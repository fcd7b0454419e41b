"""Hugging Face interop: `from_hf` and `to_hf`; `converter_for` exposes the config and name mapping."""
from titan_models.hf.convert import converter_for, from_hf, read_config, to_hf

__all__ = ["converter_for", "from_hf", "read_config", "to_hf"]

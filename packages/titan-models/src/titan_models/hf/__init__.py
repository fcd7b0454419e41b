"""Hugging Face interop: `from_hf` and `to_hf`."""
from titan_models.hf.convert import from_hf, to_hf

__all__ = ["from_hf", "to_hf"]

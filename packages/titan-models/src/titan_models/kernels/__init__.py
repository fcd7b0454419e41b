"""Triton kernels behind titan-models' components (imported lazily: triton is optional off Linux)."""

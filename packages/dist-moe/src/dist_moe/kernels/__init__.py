"""Triton kernels (imported only when the Triton path runs, so CPU installs need no triton)."""

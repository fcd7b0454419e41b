"""Batch-invariant mode: ops with a fixed reduction order (torch on CPU, Triton on GPU) and the
transform that makes a titan-models model use them."""
from titan_rl.batch_invariant import ops
from titan_rl.batch_invariant.mode import batch_invariant, is_batch_invariant

__all__ = ["batch_invariant", "is_batch_invariant", "ops"]

"""Let triton < 3.7's interpreter (TRITON_INTERPRET=1, the CPU check of the kernels) run loops whose
bounds are kernel scalars (the Gated DeltaNet kernels; titan-train's blockwise fp8 GEMM and titan-rl's
batch-invariant kernels use it too).

The interpreter keeps every scalar as a one-element numpy array, and `range(0, n)` calls
`n.__index__`, which triton 3.6 implements as `int(array)`: numpy 2 refuses that for one-dimensional
arrays. triton 3.8 squeezes the array first; this gives older interpreters the same behaviour.
Compiled kernels never run this code.
"""
from __future__ import annotations

_applied = False


def _scalar_index(self) -> int:
    return int(self.handle.data.reshape(-1)[0])


def backport_scalar_index() -> None:
    """Wrap the interpreter's per-launch patch of `tl.tensor` so `__index__` squeezes (idempotent)."""
    global _applied
    if _applied:
        return
    _applied = True
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:  # no interpreter in this triton
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # an interpreter organised differently (triton >= 3.7 needs no fix)
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    interpreter._patch_lang_tensor = patch_lang_tensor

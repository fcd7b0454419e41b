"""Make triton < 3.7's interpreter (TRITON_INTERPRET=1) run loops whose bounds are kernel scalars.

The interpreter holds every scalar (a kernel argument, a scalar load, a reduction) as a
one-element numpy array, and a Python `range(0, n)` over one calls `n.__index__`, which triton 3.6
implements as `int(array)`: numpy 2 refuses that for arrays of one dimension ("only 0-dimensional
arrays can be converted to Python scalars"). triton 3.8 squeezes the array first; this applies
the same fix to older interpreters. Compiled kernels are unaffected (nothing here runs then).
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
    except ImportError:  # pragma: no cover - no interpreter in this triton
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # pragma: no cover - a triton whose interpreter is organised differently
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    interpreter._patch_lang_tensor = patch_lang_tensor

"""Replace modules selected by name patterns with another implementation of the same interface."""
from __future__ import annotations

import fnmatch
from typing import Callable

from torch import nn


def _matches(pattern: str, name: str) -> bool:
    """`*` (or any glob) matches within one path component: "layers.*.moe" matches "layers.3.moe"."""
    parts, name_parts = pattern.split("."), name.split(".")
    return len(parts) == len(name_parts) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, name_parts))


def _signature(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """What a checkpoint sees: parameter and persistent-buffer names with their shapes."""
    return {name: tuple(t.shape) for name, t in module.state_dict(keep_vars=True).items()}


def override(model: nn.Module, pattern: str, factory: Callable[[str, nn.Module], nn.Module], *,
             adds_parameters: bool = False) -> list[str]:
    """Replace each module whose name matches `pattern` by `factory(name, old_module)`.

    All replacements are made and checked before any is installed: a pattern that matches nothing,
    a factory that returns a non-module, or a replacement whose parameter/buffer names or shapes
    differ from the original's raises ValueError (so weights and checkpoints carry over).
    adds_parameters: the replacement may hold parameters of its own beside the original's (an adapter,
    e.g. LoRA); it must still keep every original name with its shape.
    Returns the replaced module names.
    """
    targets = [(name, mod) for name, mod in model.named_modules() if name and _matches(pattern, name)]
    if not targets:
        sample = [name for name, _ in model.named_modules() if name][:8]
        raise ValueError(f"override pattern {pattern!r} matches no module (module names look like {sample})")
    replacements = []
    for name, old in targets:
        new = factory(name, old)
        if not isinstance(new, nn.Module):
            raise TypeError(f"override factory for {name!r} returned {type(new).__name__}, not an nn.Module")
        want, got = _signature(old), _signature(new)
        if adds_parameters:
            got = {k: v for k, v in got.items() if k in want}
        if want != got:
            missing = sorted(set(want) - set(got))
            extra = sorted(set(got) - set(want))
            reshaped = sorted(f"{k}: {want[k]} -> {got[k]}" for k in set(want) & set(got) if want[k] != got[k])
            raise ValueError(
                f"override of {name!r} by {type(new).__name__} changes its interface: "
                f"missing {missing}, unexpected {extra}, shape changes {reshaped}"
            )
        replacements.append((name, new))
    for name, new in replacements:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    return [name for name, _ in replacements]


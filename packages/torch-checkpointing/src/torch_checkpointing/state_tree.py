"""A state dict as a flat list of leaves with dotted paths, and back.

Containers: dicts (str or int keys), lists, and stateful objects (anything with `state_dict()` and
`load_state_dict()`, such as nn.Module, ModelState, OptimizerState), expanded in place. Leaves:
tensors and DTensors, bytes, and plain values (None, bool, int, float, str, torch.dtype, and tuples
or lists of those), which are stored as JSON.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# torch.dtype: optimizers keep them in param groups (e.g. the dtype of Muon's Newton-Schulz iteration)
PLAIN_SCALARS = (type(None), bool, int, float, str, torch.dtype)
ALLOWED = "dict, list, tensor, DTensor, bytes, None, bool, int, float, str, torch.dtype, or a tuple/list of those scalars"


@dataclass(slots=True)
class Leaf:
    path: str
    value: Any
    parent: Any  # the dict or list holding the value, so a load can replace immutable values
    key: Any


@dataclass(slots=True)
class Tree:
    leaves: list[Leaf]
    statefuls: list[tuple[Any, Any]]  # (object, its state_dict) in the order they were met


def is_stateful(value: Any) -> bool:
    return (
        not isinstance(value, (torch.Tensor, dict, list, tuple))
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def _is_plain_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(v, PLAIN_SCALARS) or _is_plain_sequence(v) for v in value
    )


def flatten(state: Any) -> Tree:
    """Every leaf of `state` with its path; stateful objects' state_dict() is expanded."""
    if not isinstance(state, dict):
        raise TypeError(f"the checkpoint state must be a dict, got {type(state).__name__}")
    tree = Tree(leaves=[], statefuls=[])
    seen: set[str] = set()
    _walk(state, "", tree, seen)
    return tree


def _walk(container: Any, prefix: str, tree: Tree, seen: set[str]) -> None:
    items = container.items() if isinstance(container, dict) else enumerate(container)
    for key, value in items:
        if isinstance(container, dict) and (isinstance(key, bool) or not isinstance(key, (str, int))):
            raise TypeError(f"state key {key!r} under {prefix or '<root>'!r} must be a str or an int")
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, torch.optim.Optimizer):
            raise TypeError(
                f"state {path!r} is an optimizer: wrap it as torch_checkpointing.OptimizerState(model, optimizer), "
                "whose state is keyed by parameter name (a plain optimizer.state_dict() uses positions and "
                "has no state before the first step)"
            )
        if is_stateful(value):
            inner = value.state_dict()
            if not isinstance(inner, dict):
                raise TypeError(f"{path}.state_dict() returned {type(inner).__name__}; expected a dict")
            tree.statefuls.append((value, inner))
            _walk(inner, path, tree, seen)
        elif isinstance(value, dict) or (isinstance(value, list) and not _is_plain_sequence(value)):
            _walk(value, path, tree, seen)
        elif isinstance(value, (torch.Tensor, bytes, bytearray)) or isinstance(value, PLAIN_SCALARS) or _is_plain_sequence(value):
            if path in seen:
                raise ValueError(f"two state entries share the path {path!r}; keys may not contain '.' ambiguously")
            seen.add(path)
            tree.leaves.append(Leaf(path, value, container, key))
        else:
            raise TypeError(f"state {path!r} is a {type(value).__name__}; allowed: {ALLOWED}")


def encode_value(value: Any) -> Any:
    """A plain value as JSON that any reader parses (non-finite floats and tuples are tagged)."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    return value


def decode_value(data: Any) -> Any:
    if isinstance(data, dict):
        if "float" in data:
            return float(data["float"])
        if "dtype" in data:
            dtype = getattr(torch, data["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"stored dtype {data['dtype']!r} is not a dtype of this torch version")
            return dtype
        return tuple(decode_value(v) for v in data["tuple"])
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    return data

"""The conversion pass: which nn.Linear modules of a model (by name) become QuantizedLinears.

Applied from outside the model, on meta, after the MoE layers are swapped in and before parallelism, activation
checkpointing, compile and FSDP wrap it (parallelizer.py). The swap keeps each module's Parameters, so
weights, checkpoints and initialisation are those of the unconverted model.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections.abc import Mapping

from torch import nn

from .linear import QuantizedLinear
from .recipes import RECIPES, blockable

# Modules the default selection leaves out: the output head (its logits feed the loss, and titan-train's fused
# loss reads its weight directly) and MoE routers and gates (small GEMMs whose scores decide the routing).
DEFAULT_EXCLUDED = ("output", "*.output", "*.router.*", "*.shared_gate")
# The trainer's fused chunked loss multiplies the head's weight itself (never calling the module), so a
# converted head would silently stay in high precision: never converted.
HEAD = "output"


def matches(pattern: str, name: str) -> bool:
    """`*` matches within one name component ('layers.*.attention.wq'), as titan_models.override's patterns;
    a pattern with `**` matches across components ('**.w2')."""
    if "**" in pattern:
        return fnmatch.fnmatchcase(name, pattern.replace("**", "*"))
    parts, name_parts = pattern.split("."), name.split(".")
    return len(parts) == len(name_parts) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, name_parts))


def _default_selected(name: str) -> bool:
    return not any(fnmatch.fnmatchcase(name, pattern) for pattern in DEFAULT_EXCLUDED)


class LinearConversion:
    """quantize.linear's recipe over the Linears `modules` selects (empty: every nn.Linear except the head
    and routers)."""

    def __init__(self, recipe: str, modules: tuple[str, ...] = (), *, backend: str = "auto", fast_accum: bool = False):
        if recipe not in RECIPES:
            raise ValueError(f"quantize.linear={recipe!r}: allowed none, {', '.join(RECIPES)}")
        self.recipe, self.modules, self.backend = RECIPES[recipe], modules, backend
        if fast_accum:
            if self.recipe.kernel != "scaled_mm":
                raise ValueError(f"quantize.fast_accum is torch._scaled_mm's option (fp8_tensorwise, fp8_rowwise); "
                                 f"{recipe} runs its own GEMM")
            self.recipe = dataclasses.replace(self.recipe, forward_fast_accum=True)

    def select(self, model: nn.Module, *, partial: bool = False) -> list[str]:
        """The names of the plain nn.Linear modules the patterns select (each pattern must select one, unless
        `model` is part of the model: a pipeline rank's stages)."""
        linears = [name for name, m in model.named_modules() if name and type(m) is nn.Linear]
        if not self.modules:
            return [name for name in linears if _default_selected(name)]
        selected = []
        modules = dict(model.named_modules())
        for pattern in self.modules:
            if pattern in modules and type(modules[pattern]) is not nn.Linear:
                raise ValueError(f"quantize.modules: {pattern} is a {type(modules[pattern]).__name__}, not an "
                                 "nn.Linear (LoRA-adapted and already converted Linears are left as they are)")
            hits = [name for name in linears if matches(pattern, name)]
            if not hits and not partial:
                raise ValueError(f"quantize.modules: {pattern!r} matches no nn.Linear (names look like "
                                 f"{linears[:4]})")
            selected += [name for name in hits if name not in selected]
        return selected

    def apply(self, model: nn.Module, *, partial: bool = False, tp: int = 1,
              tp_styles: Mapping[str, str] | None = None) -> list[str]:
        """Swap the selected Linears in place; returns the converted names. A selected Linear whose shape the
        recipe cannot block stays as it is, with a warning, unless the user named it exactly (ValueError).
        partial: `model` holds some of the model's modules only (a pattern may match none of them).
        tp, tp_styles: the tensor-parallel degree and the style (colwise, rowwise, ...) of each Linear the plan
        shards: a colwise Linear's out_features and a rowwise one's in_features are cut tp ways, and each rank's
        shard must be blockable on its own (tensor_parallel.py: then its blocks are the 1-process ones)."""
        converted, skipped = [], []
        for name in self.select(model, partial=partial):
            linear = model.get_submodule(name)
            if name == HEAD:
                if name in self.modules:
                    raise ValueError("quantize.modules names the output head, whose weight the fused loss multiplies "
                                     "itself (the module is never called): drop it from quantize.modules")
                skipped.append(f"{name}: the output head (the fused loss multiplies its weight itself)")
                continue
            style = (tp_styles or {}).get(name) if tp > 1 else None
            out_split, in_split = (tp if style == "colwise" else 1), (tp if style == "rowwise" else 1)
            splits_evenly = linear.in_features % in_split == 0 and linear.out_features % out_split == 0
            if not (splits_evenly and blockable(self.recipe, linear.in_features // in_split,
                                                linear.out_features // out_split)):
                reason = (f"{name} [{linear.out_features} x {linear.in_features}]: {self.recipe.name} needs "
                          f"in_features and out_features divisible by {self.recipe.weight_multiple}")
                if style in ("colwise", "rowwise"):
                    reason += (f" after the {style} split over tp={tp} (local "
                               f"[{linear.out_features // out_split} x {linear.in_features // in_split}])")
                if name in self.modules:
                    raise ValueError(f"quantize.modules names {reason}; drop it from quantize.modules")
                skipped.append(reason)
                continue
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, QuantizedLinear(linear, recipe=self.recipe, backend=self.backend))
            converted.append(name)
        if skipped:
            warnings.warn("quantize.linear: left in high precision: " + "; ".join(skipped),
                          stacklevel=2)
        return converted

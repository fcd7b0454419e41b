"""torch.compile where it pays: the modules an FQN pattern selects, each with its own options.

`compile.mode=regions` compiles the modules `compile.regions` selects; `compile.mode=blocks` is the case
'layers.*=default'. Modules compile in place (nn.Module.compile), so parameter names do not change and
FSDP, checkpoints and the optimizer see the same model. Patterns match module paths with the wrapper
components activation checkpointing inserts taken out, so `layers.*.attention` selects the attention of
checkpointed blocks too. A selected module that activation checkpointing wrapped whole (the blocks under
activation_checkpoint.mode full/selective/remat) compiles with its wrapper: the checkpoint is then traced
into the compiled graph, so the backward recomputes in compiled code and a selective policy decides what
the compiled graph saves (compiled inside an eager checkpoint, the block's recompute would run eagerly, and
torch >= 2.12 refuses a selective policy over compiled ops it never saw dispatched).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch.nn as nn

from .config import CompileConfig, RegionRules

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
BLOCKS: RegionRules = (("layers.*", "default"),)
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass(frozen=True, kw_only=True)
class RegionOptions:
    """The torch.compile options of one region."""

    mode: str = "default"
    fullgraph: bool = False
    dynamic: bool | None = None
    """None: torch's own choice (static first, dynamic after a shape change)."""


def parse_region_options(text: str, pattern: str) -> RegionOptions:
    """'max-autotune/fullgraph/dynamic' -> RegionOptions (ValueError naming the pattern otherwise)."""
    mode, *flags = [part.strip() for part in text.split("/")]
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile.regions {pattern}={text}: unknown mode {mode!r}; "
                         f"allowed: {', '.join(COMPILE_MODES)}")
    unknown = [f for f in flags if f not in ("fullgraph", "dynamic", "static")]
    if unknown or ("dynamic" in flags and "static" in flags):
        raise ValueError(f"compile.regions {pattern}={text}: flags after the mode are /fullgraph and one of "
                         f"/dynamic or /static; got {'/'.join(flags)}")
    dynamic = True if "dynamic" in flags else False if "static" in flags else None
    return RegionOptions(mode=mode, fullgraph="fullgraph" in flags, dynamic=dynamic)


def plain_path(name: str) -> str:
    """A module path without the components wrappers insert (checkpoint_wrapper, torch.compile)."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name.removesuffix("._checkpoint_wrapped_module").removesuffix("._orig_mod")


def select_regions(model: nn.Module, rules: RegionRules) -> list[tuple[str, nn.Module, RegionOptions]]:
    """(plain path, module, options) for each module a rule selects, first matching rule wins; a rule that
    selects nothing is a ValueError naming it (with every such rule)."""
    parsed = [(pattern, parse_region_options(options, pattern)) for pattern, options in rules]
    chosen: dict[str, tuple[nn.Module, RegionOptions]] = {}
    unmatched = []
    for pattern, options in parsed:
        depth, hits = pattern.count("."), 0
        for name, module in model.named_modules():
            path = plain_path(name)
            if not name or path.count(".") != depth or not fnmatch.fnmatchcase(path, pattern):
                continue
            if isinstance(module, nn.Module) and type(module).__name__ == "CheckpointWrapper":
                continue  # select the wrapped module itself (same plain path)
            hits += 1
            chosen.setdefault(path, (module, options))
        if not hits:
            unmatched.append(pattern)
    if unmatched:
        sample = ", ".join(plain_path(n) for n, _ in list(model.named_modules())[1:8])
        raise ValueError(f"compile.regions: no module matches {', '.join(unmatched)} (module paths look like "
                         f"{sample}, ...)")
    nested = [p for p in chosen if any(p.startswith(q + ".") for q in chosen)]
    if nested:
        raise ValueError(f"compile.regions: {', '.join(nested)} lie inside another selected region; "
                         "select either the outer or the inner modules")
    return [(path, module, options) for path, (module, options) in chosen.items()]


def apply_compile_regions(model: nn.Module, config: CompileConfig) -> list[str]:
    """Compile the regions of `config` (blocks: every transformer block) in place; returns their paths."""
    rules = BLOCKS if config.effective_mode == "blocks" else config.regions
    regions = select_regions(model, rules)
    wrappers = {id(m._checkpoint_wrapped_module): m for m in model.modules() if type(m).__name__ == "CheckpointWrapper"}
    for _, module, options in regions:
        module = wrappers.get(id(module), module)  # the checkpoint inside the compiled region
        module.compile(backend=config.backend, fullgraph=options.fullgraph, dynamic=options.dynamic,
                       mode=None if options.mode == "default" else options.mode)
    return [path for path, _, _ in regions]

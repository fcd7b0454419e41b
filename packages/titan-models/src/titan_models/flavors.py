"""The flavor registry: `flavor(family, name)` returns a fresh config to build or transform."""
from __future__ import annotations

import copy
from typing import Any

from titan_models.models import deepseek_v3, gpt_oss, llama3, qwen3

_FAMILIES: dict[str, dict[str, Any]] = {
    "llama3": llama3.FLAVORS,
    "qwen3": qwen3.FLAVORS,
    "deepseek_v3": deepseek_v3.FLAVORS,
    "gpt_oss": gpt_oss.FLAVORS,
}


def families() -> list[str]:
    return sorted(_FAMILIES)


def flavors(family: str) -> list[str]:
    return list(_flavor_table(family))


def flavor(family: str, name: str) -> Any:
    """A copy of the named config (e.g. `flavor("llama3", "8B")`); edit or transform it freely."""
    table = _flavor_table(family)
    if name not in table:
        raise ValueError(f"unknown {family} flavor {name!r}; choose one of {sorted(table)}")
    return copy.deepcopy(table[name])


def _flavor_table(family: str) -> dict[str, Any]:
    if family not in _FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {families()}")
    return _FAMILIES[family]

"""Per-parameter placements and the rules that pick one for each parameter name."""
from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class RowShard:
    """Dim-0 shards in `torch.chunk` layout: rank r holds rows [r*ceil(n/W), (r+1)*ceil(n/W)).

    The same layout as `fully_shard` and DTensor `Shard(0)`, so state dicts are interchangeable.
    """

    def __str__(self) -> str:
        return "RowShard()"


@dataclass(frozen=True, kw_only=True)
class Owned:
    """The whole parameter lives on one rank; its gradient is reduced to that rank.

    `rank=None` lets a balancing policy pick the owner (largest parameters first, each to the rank
    holding the fewest elements so far in the bucket, ties broken by the load across earlier calls).
    """

    rank: int | None = None

    def __str__(self) -> str:
        return "Owned()" if self.rank is None else f"Owned(rank={self.rank})"


@dataclass(frozen=True, kw_only=True)
class BlockShard:
    """A 2-D parameter cut into `block=(rows, cols)` tiles; each rank holds a contiguous run of tiles
    (row-major tile order, counts differing by at most one), so every tile lives whole on one rank.

    `quantize="fp8_e4m3"` all-gathers the tiles as e4m3 with one fp32 scale per tile, computed by the
    tile's owner (the gathered weight equals gathering in `param_dtype` and quantizing afterwards).
    `scales`: "amax" (amax / 448) or "pow2" (2^-p, p the largest integer with amax * 2^p <= 448: exact to
    dequantize, the rule of fp8 training recipes that consume the gathered e4m3 directly, see
    `gathered_fp8`).
    """

    block: tuple[int, int]
    quantize: str | None = None
    scales: str = "amax"

    def __post_init__(self) -> None:
        if (
            not isinstance(self.block, tuple)
            or len(self.block) != 2
            or not all(isinstance(b, int) and b > 0 for b in self.block)
        ):
            raise ValueError(f"BlockShard(block=...) takes two positive ints (rows, cols), got {self.block!r}")
        if self.quantize not in (None, "fp8_e4m3"):
            raise ValueError(f"BlockShard(quantize=...) takes None or 'fp8_e4m3', got {self.quantize!r}")
        if self.scales not in ("amax", "pow2"):
            raise ValueError(f"BlockShard(scales=...) takes 'amax' or 'pow2', got {self.scales!r}")

    def __str__(self) -> str:
        q = f", quantize={self.quantize!r}" if self.quantize else ""
        q += f", scales={self.scales!r}" if self.scales != "amax" else ""
        return f"BlockShard(block={self.block}{q})"


Placement = RowShard | Owned | BlockShard
PlacementRule = Placement | Mapping[str, Placement] | Callable[[str, torch.Tensor], "Placement | None"] | None


def resolve_placement(rule: PlacementRule, name: str, param: torch.Tensor) -> Placement:
    """The placement `rule` gives parameter `name`; RowShard when nothing matches."""
    if rule is None:
        placement: object = RowShard()
    elif isinstance(rule, (RowShard, Owned, BlockShard)):
        placement = rule
    elif isinstance(rule, Mapping):
        placement = next((p for pat, p in rule.items() if fnmatch.fnmatchcase(name, pat)), RowShard())
    elif callable(rule):
        placement = rule(name, param)
        placement = RowShard() if placement is None else placement
    else:
        raise TypeError(
            f"placements must be a placement, a dict of name patterns to placements, or a function "
            f"(name, param) -> placement; got {type(rule).__name__}"
        )
    if not isinstance(placement, (RowShard, Owned, BlockShard)):
        raise TypeError(f"placement for {name!r} must be RowShard, Owned or BlockShard, got {placement!r}")
    if isinstance(placement, BlockShard) and param.dim() != 2:
        raise ValueError(f"BlockShard needs a 2-D parameter; {name!r} has shape {tuple(param.shape)} (use RowShard or Owned)")
    if isinstance(placement, RowShard) and param.dim() == 0:
        raise ValueError(f"RowShard needs at least one dimension; {name!r} is a scalar (use Owned)")
    return placement


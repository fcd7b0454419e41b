"""`layout(module)`: a printable table of buckets, placements and per-rank sizes."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .bucket import Bucket
from .placements import Owned


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


@dataclass(frozen=True)
class ShardLayout:
    """What `print(flexshard.layout(model))` shows; `buckets` holds (module path, Bucket) pairs."""

    buckets: list[tuple[str, Bucket]]

    def __str__(self) -> str:
        if not self.buckets:
            return "flexshard layout: no sharded parameters"
        world = self.buckets[0][1].world
        lines = [f"flexshard layout: {len(self.buckets)} buckets over {world} ranks (elements held per rank)"]
        for number, (prefix, b) in enumerate(self.buckets):
            trigger = ".".join(p for p in (prefix, b.trigger_name) if p) or "<root>"
            lines.append(
                f"bucket {number:<3} gathered in {trigger}: all-gather {_size(b.all_gather_bytes())}, "
                f"reduce-scatter {_size(b.reduce_scatter_bytes())} ({b.rs_dtype}), "
                f"reshard after forward: {b.reshard_after_forward}"
            )
            names = [f"{prefix}.{s.fqn}" if prefix else s.fqn for s in b.slots]
            shown = [
                f"Owned(rank={s.layout.owner()})" if isinstance(s.layout.placement, Owned) else str(s.layout.placement)
                for s in b.slots
            ]
            w_name, w_shown = max(map(len, names)), max(map(len, shown))
            for s, name, placement in zip(b.slots, names, shown):
                counts = " ".join(f"{s.layout.local_numel(r):>8}" for r in range(world))
                lines.append(f"  {name:<{w_name}} {str(list(s.layout.shape)):<14} {placement:<{w_shown}} {counts}")
        return "\n".join(lines)


def layout(module: nn.Module) -> ShardLayout:
    """Every bucket under `module`, in module order."""
    out = []
    for path, m in module.named_modules():
        state = getattr(m, "_flexshard_state", None)
        if state is not None:
            out.extend((path, b) for b in state.buckets)
    return ShardLayout(out)

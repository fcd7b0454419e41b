"""Several sources mixed by weight: each packed row comes whole from one source, chosen by a draw that is a
function of (seed, row number) only, so the mixture is deterministic and a resumed run (row counter plus
every source's cursor) continues it exactly."""
from __future__ import annotations

import numpy as np

from .loader import Batch, PackedLoader, pack_rows


class MixedLoader:
    def __init__(self, loaders: list[PackedLoader], weights: list[float], *, seed: int):
        if len(loaders) != len(weights) or not loaders:
            raise ValueError("data.sources needs at least one source=weight pair")
        total = float(sum(weights))
        self.loaders, self.seed = loaders, seed
        self.bounds = np.cumsum([w / total for w in weights])
        self.rows_drawn = 0
        self.document_masking = loaders[0].document_masking

    def source_of(self, row: int) -> int:
        """Which source row number `row` of the stream comes from."""
        draw = np.random.default_rng([self.seed, row]).random()
        return min(int(np.searchsorted(self.bounds, draw, side="right")), len(self.loaders) - 1)

    def next_batch(self, rows: int) -> Batch:
        picked = []
        for _ in range(rows):
            picked.append(self.loaders[self.source_of(self.rows_drawn)].row())
            self.rows_drawn += 1
        return pack_rows(picked, document_masking=self.document_masking)

    def state_dict(self) -> dict:
        return {"rows_drawn": self.rows_drawn, "sources": [loader.state_dict() for loader in self.loaders]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["sources"]) != len(self.loaders):
            raise ValueError(f"the checkpoint mixed {len(state['sources'])} data sources, data.sources names "
                             f"{len(self.loaders)}")
        self.rows_drawn = int(state["rows_drawn"])
        for loader, inner in zip(self.loaders, state["sources"]):
            loader.load_state_dict(inner)

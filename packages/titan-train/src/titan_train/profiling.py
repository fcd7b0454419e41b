"""--profiling.steps: torch.profiler over chosen steps, a Chrome/Perfetto trace per rank, a one-line
summary of where the time went; --profiling.memory_snapshot: torch's CUDA allocation history as the
pickle pytorch.org/memory_viz reads."""
from __future__ import annotations

from pathlib import Path

import torch

from .trace_summary import load_events, one_line, summarize

SNAPSHOT_STEPS = 3  # recorded when memory_snapshot is asked for without profiling.steps


class StepProfiler:
    def __init__(self, folder: Path, *, steps: tuple[int, ...], memory_snapshot: bool, rank: int,
                 device: torch.device):
        self.folder, self.rank, self.device = folder, rank, device
        self.steps = tuple(sorted(steps))
        self.memory = memory_snapshot and device.type == "cuda"  # the allocator history is CUDA's
        window = self.steps or ((1, SNAPSHOT_STEPS) if self.memory else ())
        self.first, self.last = (window[0], window[-1]) if window else (0, -1)
        self._profile = None
        self.trace: Path | None = None
        self.summary = ""

    def before(self, step: int) -> None:
        if step != self.first:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        if self.steps:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.__enter__()

    def after(self, step: int) -> None:
        if step != self.last:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self.trace = self.folder / f"trace_rank{self.rank}.json"
            self._profile.export_chrome_trace(str(self.trace))
            self._profile = None
            self.summary = (f"titan-train: profiled steps {self.first}-{self.last} ({self.trace}): "
                            + one_line(summarize(load_events(self.trace))))
            if self.rank == 0:
                print(self.summary, flush=True)
        if self.memory:
            torch.cuda.memory._dump_snapshot(str(self.folder / f"memory_snapshot_rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)

    def close(self) -> None:
        """A run that stopped inside the window: end the profiler without writing."""
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._profile = None

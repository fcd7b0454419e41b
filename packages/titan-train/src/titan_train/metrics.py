"""Metrics of each logged step: one JSON object per line in <job.folder>/metrics.jsonl, and the same
scalars as TensorBoard events beside it (rank 0 only)."""
from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch

# Dense bf16 peak FLOP/s of the accelerators MFU is reported against (vendor datasheets, without sparsity).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is lower (756e12) and named "H100 PCIe"
    "H100 PCIe": 756e12,
    "H800": 989e12,
    "A100": 312e12,
    "B200": 2250e12,
    "GH200": 989e12,
    "L40S": 362e12,
}


def peak_flops(device: torch.device) -> float | None:
    """The bf16 dense peak of `device` when known (None on CPUs and unknown accelerators)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    matches = [key for key in PEAK_BF16_FLOPS if key in name]
    return PEAK_BF16_FLOPS[max(matches, key=len)] if matches else None


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated on the GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def memory_reserved_gib(device: torch.device) -> float | None:
    """Peak memory the GPU allocator held from the device (allocated + cached, fragmentation included): what
    an out-of-memory error is about, beside memory_gib's allocated peak. None off CUDA."""
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None


class MetricsWriter:
    def __init__(self, folder: Path, *, tensorboard: bool, start_step: int = 0, sinks: list | None = None):
        """sinks: more writers of each record (write(record), close()), e.g. tracking.WandbSink."""
        self.sinks = list(sinks or [])
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "metrics.jsonl"
        if start_step and self.path.exists():
            _keep_records_up_to(self.path, start_step)
        # Resumed: append after the kept records (already on disk, so a kill before the next line loses
        # nothing). Fresh: start the file again.
        self._file = open(self.path, "a" if start_step else "w", encoding="utf-8")
        self._tb = None
        if tensorboard:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard writes through it; fail early if absent)
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(folder / "tensorboard"))

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self.sinks:
            sink.close()


def _keep_records_up_to(path: Path, step: int) -> None:
    """Rewrite `path` with its records of steps <= `step` only, atomically (a kill at any moment leaves
    either the old file or the new one): a killed run may have logged steps past its last checkpoint,
    which the resumed run redoes and logs again."""
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            pass  # a line cut short by the kill
    partial = path.with_name(path.name + ".tmp")
    with open(partial, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)

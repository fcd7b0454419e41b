"""Where a profiled step's time went, from a Chrome trace written by torch.profiler: compute,
communication and idle. On a GPU the device's kernels and copies are measured (collectives are the
nccl kernels); on a CPU the host operations (collectives are the c10d / gloo ones)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
COMM_MARKERS = ("nccl", "c10d::", "gloo", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                "broadcast", "alltoall", "all_to_all", "send", "recv")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def is_communication(event: dict) -> bool:
    name = event.get("name", "").lower()
    return any(marker in name for marker in COMM_MARKERS)


def summarize(events: list[dict]) -> dict[str, float]:
    """{where, span_ms, compute_ms, communication_ms, idle_ms} over the traced window."""
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    where = "device"
    if not device:  # a CPU run: the host's operators
        where, device = "host", [e for e in events if e.get("cat") == "cpu_op"]
    if not device:
        return {"where": where, "span_ms": 0.0, "compute_ms": 0.0, "communication_ms": 0.0, "idle_ms": 0.0}
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in device]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in device if is_communication(e)]
    span = max(b for _, b in intervals) - min(a for a, _ in intervals)
    busy, communication = union_length(intervals), union_length(comm)
    return {"where": where, "span_ms": span / 1e3, "compute_ms": (busy - communication) / 1e3,
            "communication_ms": communication / 1e3, "idle_ms": (span - busy) / 1e3}


def one_line(summary: dict[str, float]) -> str:
    span = summary["span_ms"] or 1.0
    parts = [f"{name} {summary[f'{name}_ms']:.1f} ms ({100 * summary[f'{name}_ms'] / span:.0f}%)"
             for name in ("compute", "communication", "idle")]
    return f"{summary['where']} time over {summary['span_ms']:.1f} ms: " + ", ".join(parts)

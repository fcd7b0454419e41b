"""Where a profiled GPU stream sits idle, and what the host was doing meanwhile.

    python tools/bench/train_throughput/gpu_gaps.py trace.json.gz [--top 15]

Reads a Chrome trace written by torch.profiler (`prof.export_chrome_trace`), merges the device
activity (kernels, copies, memsets) into busy intervals, and prints the total busy and idle time
and the longest idle gaps with the device work on either side and the host operations that were
running during each gap (the innermost first), so a wait can be traced to the call that caused it.
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"}


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def gaps(events: list[dict], *, min_us: float = 20.0) -> tuple[float, float, list[tuple[float, float, dict, dict]]]:
    """(busy µs, span µs, idle gaps [(start, end, work before, work after)] of at least `min_us`)."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    if not device:
        return 0.0, 0.0, []
    busy, found = 0.0, []
    cur_start, cur_end, last = device[0]["ts"], device[0]["ts"] + device[0]["dur"], device[0]
    for e in device[1:]:
        start, end = e["ts"], e["ts"] + e["dur"]
        if start > cur_end:
            busy += cur_end - cur_start
            if start - cur_end >= min_us:
                found.append((cur_end, start, last, e))
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
        if end >= cur_end:
            last = e
    busy += cur_end - cur_start
    return busy, cur_end - device[0]["ts"], found


def host_ops_during(events: list[dict], start: float, end: float, limit: int = 4) -> list[str]:
    """Host operations overlapping [start, end], the shortest (innermost) first, with their overlap."""
    spans = []
    for e in events:
        if e.get("cat") not in HOST_CATS:
            continue
        s, t = e["ts"], e["ts"] + e["dur"]
        overlap = min(t, end) - max(s, start)
        if overlap > 0.5 * (end - start):
            spans.append((e["dur"], e["name"], overlap))
    spans.sort()
    return [f"{name[:60]} ({dur / 1e3:.2f} ms)" for dur, name, _ in spans[:limit]]


def report(path: Path, top: int = 15) -> str:
    events = load_events(path)
    busy, span, found = gaps(events)
    idle = sum(b - a for a, b, _, _ in found)
    lines = [f"device: busy {busy / 1e3:.1f} ms of {span / 1e3:.1f} ms traced; idle in gaps >= 20 us: "
             f"{idle / 1e3:.1f} ms over {len(found)} gaps"]
    for a, b, before, after in sorted(found, key=lambda g: g[0] - g[1])[:top]:
        lines.append(f"  {(b - a) / 1e3:7.2f} ms idle  after {before['name'][:50]!r}  before {after['name'][:50]!r}")
        for op in host_ops_during(events, a, b):
            lines.append(f"             host: {op}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    print(report(args.trace, args.top))


if __name__ == "__main__":
    main()

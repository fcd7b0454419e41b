"""Running one titan-train job in a subprocess and reading its metrics (shared by this folder's benches)."""
from __future__ import annotations

import json
import re
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run_job(args: list[str], *, timeout: float) -> dict:
    """titan-train `args` in a fresh process (an OOM or a crash ends only that variant); returns its metrics:
    step seconds (median after the first two), first-step seconds, peak memory GiB, tokens/s, or the error."""
    job = Path(tempfile.mkdtemp(prefix="titan_exec_bench_"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in sorted((ROOT / "packages").glob("*/src"))))
    cmd = [sys.executable, "-m", "titan_train", *args, "--job.folder", str(job), "--checkpoint.interval", "0",
           "--checkpoint.resume", "false", "--metrics.tensorboard", "false", "--metrics.progress", "false"]
    began = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    wall = time.perf_counter() - began
    metrics = job / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"error": _oom_summary(proc.stderr) if "OutOfMemory" in proc.stderr else tail[0][:800], "wall_s": wall}
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steady = [r["step_seconds"] for r in records[2:]] or [records[-1]["step_seconds"]]
    step = statistics.median(steady)
    plan = job / "remat_plan.json"
    return {"step_s": step, "first_step_s": records[0]["step_seconds"], "compile_s": records[0]["step_seconds"] - step,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[2:] or records[-1:]),
            "memory_gib": max(r["memory_gib"] or 0 for r in records),
            "reserved_gib": max(r.get("memory_reserved_gib") or 0 for r in records), "wall_s": wall,
            "plan": json.loads(plan.read_text()) if plan.exists() else None}


def _oom_summary(stderr: str) -> str:
    """'OOM' with the allocator's own account from torch's message (what was asked, what is free, allocated,
    reserved but unallocated): tells a plan that counted too little from one the allocator's cache fragmented."""
    found = re.search(r"Tried to allocate ([\d.]+ [KMG]iB).*?([\d.]+ [KMG]iB) is free.*?([\d.]+ [KMG]iB) is allocated by "
                      r"PyTorch, and ([\d.]+ [KMG]iB) is reserved by PyTorch but unallocated", stderr, re.S)
    if not found:
        return "OOM"
    asked, free, allocated, cached = found.groups()
    return f"OOM (asked {asked}, free {free}, allocated {allocated}, reserved but unallocated {cached})"

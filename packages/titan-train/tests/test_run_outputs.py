"""What a run leaves besides metrics.jsonl: profiler traces and their time summary, the CUDA memory
snapshot, Weights & Biases records (a stand-in module: no network, no install), metrics.png."""
from __future__ import annotations

import json
import struct
import sys
import types
import zlib

import pytest
import torch

from titan_train import train
from titan_train.trace_summary import load_events, summarize


def test_profiled_steps_write_a_trace_and_say_where_the_time_went(tmp_path, jobs, capsys):
    train(jobs.tiny(tmp_path, **{"training.steps": "3", "profiling.steps": "2,3"}))
    trace = tmp_path / "profile" / "trace_rank0.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "cpu_op" and "mm" in e.get("name", "") for e in events)
    out = capsys.readouterr().out
    assert "titan-train: profiled steps 2-3" in out and "compute" in out and "idle" in out
    summary = summarize(load_events(trace))
    assert summary["compute_ms"] > 0 and summary["communication_ms"] == 0  # one process: no collectives


def test_summary_of_a_known_trace(tmp_path):
    # kernels 0-10 us and 5-20 us (compute, overlapping), an nccl kernel 30-40 us, idle 20-30 us
    events = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 10},
              {"ph": "X", "cat": "kernel", "name": "softmax", "ts": 5, "dur": 15},
              {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 30, "dur": 10},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = summarize(load_events(path))
    assert summary == {"where": "device", "span_ms": 0.04, "compute_ms": 0.02, "communication_ms": 0.01,
                       "idle_ms": 0.01}


def test_fsdp_trace_counts_the_collectives(tmp_path, jobs):
    jobs.on_ranks(jobs.tiny(tmp_path, **{"training.steps": "2", "profiling.steps": "2",
                                         "parallelism.dp_shard": "2"}), 2)
    for rank in (0, 1):
        summary = summarize(load_events(tmp_path / "profile" / f"trace_rank{rank}.json"))
        assert summary["communication_ms"] > 0 and summary["compute_ms"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator history is CUDA's")
def test_memory_snapshot_on_cuda(tmp_path, jobs):
    import pickle

    train(jobs.tiny(tmp_path, **{"training.steps": "3", "profiling.memory_snapshot": "true", "job.device": "cuda"}))
    snapshot = pickle.loads((tmp_path / "profile" / "memory_snapshot_rank0.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]


class FakeWandb(types.ModuleType):
    """Records what wandb.init and run.log receive."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logs, self.finished = [], [], False

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, values, step):
        self.logs.append((step, values))

    def finish(self):
        self.finished = True


def test_wandb_receives_every_record(tmp_path, jobs, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    train(jobs.tiny(tmp_path, **{"training.steps": "3", "metrics.wandb": "true", "metrics.wandb_project": "p"}))
    (init,) = fake.inits
    assert init["mode"] == "offline" and init["project"] == "p" and init["dir"] == str(tmp_path)
    assert init["config"]["training"]["steps"] == 3
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [step for step, _ in fake.logs] == [r["step"] for r in records] == [1, 2, 3]
    assert [values["loss"] for _, values in fake.logs] == [r["loss"] for r in records]
    assert fake.finished


def test_wandb_missing_is_a_clear_error(tmp_path, jobs, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'titan-train\[wandb\]'"):
        train(jobs.tiny(tmp_path, **{"training.steps": "1", "metrics.wandb": "true"}))


def test_metrics_png_plots_the_run(tmp_path, jobs):
    train(jobs.tiny(tmp_path, **{"training.steps": "4"}))
    data = (tmp_path / "metrics.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    (length,) = struct.unpack(">I", data[33:37])
    assert data[37:41] == b"IDAT"
    pixels = zlib.decompress(data[41:41 + length])
    assert len(pixels) == height * (1 + 3 * width)
    rows = [pixels[y * (1 + 3 * width) + 1:(y + 1) * (1 + 3 * width)] for y in range(height)]
    blue = [y for y, row in enumerate(rows) if bytes((31, 119, 180)) in row]  # the loss line
    green = [y for y, row in enumerate(rows) if bytes((44, 160, 44)) in row]  # the throughput line
    assert blue and green and max(blue) < height // 2 <= min(green)
    # the loss falls: its line starts high on the left (small y) and ends lower (larger y)
    left = [y for y in blue if bytes((31, 119, 180)) in rows[y][3 * 17:3 * 30]]
    assert min(left) < max(blue)

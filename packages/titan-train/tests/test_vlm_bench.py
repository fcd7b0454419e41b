"""tools/bench/vlm/bench.py --tiny: titan-train's Trainer and transformers' Qwen3VLForConditionalGeneration train
the debug Qwen3-VL on the shapes task from the same saved weights and batches, on a CPU in fp32 (its GPU figures
come from the H200 run). ~30 s on a quiet core (~110 s on a loaded one): a fresh process, one Trainer and one
transformers model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_the_vlm_benchmark_trains_titan_and_transformers_alike(tmp_path):
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, OMP_NUM_THREADS="1", OUT=str(tmp_path))
    out = subprocess.run([sys.executable, str(root / "tools/bench/vlm/bench.py"), "--tiny"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| debug | titan |" in out.stdout and "| debug | hf |" in out.stdout
    (row,) = json.loads((tmp_path / "vlm_bench.json").read_text())["rows"]
    titan, hf = row["variants"]["titan"], row["variants"]["hf"]
    assert len(titan["losses"]) == len(hf["losses"]) == 6
    # fp32 on both sides: the six steps' losses agree to rounding (1e-7 measured) while they fall from ~8 to
    # ~1.5, so the two runs see the same weights, batches, labels and updates
    for a, b in zip(titan["losses"], hf["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (titan["losses"], hf["losses"])
    assert titan["losses"][-1] < 0.5 * titan["losses"][0]

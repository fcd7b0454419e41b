"""One variant's run and its figures, shared by the benchmarks that set titan-train beside a transformers
anchor variant by variant (vlm, gated_deltanet/train_qwen35): both start from one saved init; titan's side trains through the Trainer and
reads its per-step metrics; either side's run is then summarised the same way (median and mean step, tokens/s,
peak memory, first and last loss), and a failing variant becomes an error row instead of ending the run.
"""
from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch


def save_seed0_init(model_config, folder: Path, *, device: str, dtype: torch.dtype, seq: int) -> tuple[int, float]:
    """titan-models' init (seed 0) of `model_config` as a Hugging Face folder in `dtype`, the weights both
    sides start from; (parameters, FLOPs per token at `seq`)."""
    import titan_models as tm

    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device=device)
    model.init_weights(seed=0)
    tm.to_hf(model.to(dtype), folder)
    return tm.count_params(model).total, tm.flops_per_token(model, seq)


def train_titan(config_for_job: Callable[[Path], object]) -> dict:
    """Train titan-train's job built by `config_for_job(job_folder)` in a temporary folder; its per-step
    losses and seconds, and the metrics.jsonl records themselves."""
    from titan_train import train

    with tempfile.TemporaryDirectory() as job:
        train(config_for_job(Path(job)))
        records = [json.loads(line) for line in (Path(job) / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        print(f"  titan step {r['step']}: loss {r['loss']:.4f}  {r['step_seconds'] * 1e3:.0f} ms", flush=True)
    return {"losses": [r["loss"] for r in records], "seconds": [r["step_seconds"] for r in records],
            "records": records}


def measured(run: Callable[[], dict], *, device: str, warmup: int, tokens_per_step: int) -> dict:
    """`run()`'s {"losses", "seconds"} with its figures added, or {"error": ...} when it raised (the other
    variants still run); wall_s includes its build and compilation."""
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    try:
        out = run()
    except Exception as e:  # an anchor out of memory or failing to compile must not cost the others' figures
        traceback.print_exc()
        out = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]}
    finally:
        gc.collect()
        torch._dynamo.reset()
    out["wall_s"] = time.perf_counter() - began
    if "error" in out:
        return out
    timed = out["seconds"][warmup:]
    out["step_median_s"], out["step_mean_s"] = statistics.median(timed), statistics.mean(timed)
    out["tokens_per_s"] = tokens_per_step / out["step_median_s"]
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    out["first_loss"], out["last_loss"] = out["losses"][0], statistics.mean(out["losses"][-3:])
    return out

"""Host-side cost of one Qwen3-VL training step (forward + backward) on a CPU, titan against transformers.

    uv run --frozen --no-sync python tools/bench/vlm/host_profile.py [--rows 128] [--steps 5] [--profile]

The bench's shapes batch (ShapesLoader: --rows rows of one 64x64 image, 4 image tokens each, 48 positions)
through a "host-bound" Qwen3-VL: the 2B flavor's structure (a 24-block tower with 16 heads and DeepStack after
blocks 5, 11 and 17; 7 text layers of 16 query / 8 kv heads) at tiny widths, so that what a step costs is
mostly the operators it launches, as on the GPU where the bench is launch-bound. Titan's side is
titan-train's path (Batch.to, image_inputs, CausalLMLoss with the model's own 3-D positions); transformers'
is Qwen3VLForConditionalGeneration (SDPA) on the same weights and batch, its own loss. Printed per side:
the median step (ms), and with --profile the operators one step dispatches, and its host syncs
(aten::_local_scalar_dense: .item/.tolist/int(tensor); aten::nonzero: boolean indexing, masked_scatter).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")


def host_bound_config():
    import titan_models as tm
    from titan_models.models.qwen3_vl.vision import VisionConfig

    base = tm.flavor("qwen3_vl", "debug")
    vision = VisionConfig(depth=24, dim=64, ffn_dim=128, num_heads=16, out_dim=128, num_position_embeddings=2304,
                          deepstack_layers=(5, 11, 17))
    import dataclasses

    return dataclasses.replace(base, **{"dim": 128, "num_layers": 7, "num_heads": 16, "num_kv_heads": 8, "head_dim": 16,
                         "ffn_dim": 256, "mrope_sections": (4, 2, 2), "vision": vision})


def timed(step, steps: int) -> list[float]:
    seconds = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - began)
    return seconds


def profiled(step) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    top = sum(e.count for e in events if e.key.startswith("aten::"))
    return {"aten ops": top, **{k: sum(e.count for e in events if e.key == k) for k in SYNC_OPS}}


def titan_step(model, batch, chunk: int):
    from titan_train.loss import CausalLMLoss

    loss_module = CausalLMLoss(model, chunk=chunk)

    def step():
        local = batch.to(torch.device("cpu"))
        loss = loss_module(local.tokens, local.labels, None, None, **local.image_inputs())
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def hf_step(folder: Path, batch, image_token_id: int):
    import transformers

    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                                         attn_implementation="sdpa")
    model.train()
    inputs = {"input_ids": batch.tokens, **batch.image_inputs(), "mm_token_type_ids": (batch.tokens == image_token_id).int(),
              "labels": batch.labels, "shift_labels": batch.labels}

    def step():
        model(**inputs).loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def main() -> None:
    import titan_models as tm
    from titan_train import load_recipe
    from titan_train.data.shapes import ShapesLoader
    from titan_train.data.tokenizer import ByteTokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--seq", type=int, default=48)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--sides", default="titan,hf")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = host_bound_config()
    model = cfg.build()
    model.init_weights(seed=0)
    batch = ShapesLoader(cfg, ByteTokenizer(), seq_len=args.seq, seed=0).next_batch(args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        steps = {}
        if "titan" in args.sides:
            steps["titan"] = titan_step(model, batch, load_recipe("qwen3_vl_debug_shapes").training.loss_chunk_size)
        if "hf" in args.sides:
            tm.to_hf(model, Path(tmp))
            steps["hf"] = hf_step(Path(tmp), batch, cfg.image_token_id)
        for side, step in steps.items():
            step()  # first-call costs apart
            seconds = timed(step, args.steps)
            line = f"{side:6s} forward+backward: median {statistics.median(seconds) * 1e3:.0f} ms " \
                   f"(min {min(seconds) * 1e3:.0f}) over {args.steps} steps, {args.rows} rows"
            if args.profile:
                line += "  " + "  ".join(f"{k} {v}" for k, v in profiled(step).items())
            print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())

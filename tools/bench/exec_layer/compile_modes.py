"""Step time and compile time of compile.mode none / blocks / regions (and graph) on one GPU, in one run.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/exec_layer/compile_modes.py
    (CPU check of the script:  ... compile_modes.py --tiny)

The model is tools/bench/train_throughput's Llama 3 "1.5B" (saved by transformers with random weights and
read through --model.hf_path), bf16_params, batch 4 x 4096 of random tokens, 12 steps. Step time is the
median after the first two steps; compile time is the first step's time minus that median (for graph: the
capture and passes). Each mode runs in its own process; ratios are against mode none of the same run.
none/blocks/regions use the Triton kernels (training.fused_kernels); graph runs without them.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "train_throughput"))
from common import run_job  # noqa: E402

REGIONS = "layers.*.attention=max-autotune-no-cudagraphs,layers.*.feed_forward=default/fullgraph"
MODES = {
    "none": [],
    "blocks": ["--compile.mode", "blocks"],
    "regions": ["--compile.mode", "regions", "--compile.regions", REGIONS],
    # graph mode cannot trace the raw Triton kernel launches: torch ops for the loss and SwiGLU there
    "graph": ["--compile.mode", "graph", "--compile.graph_passes", "remove_detach,eliminate_dead_code,sink_allocations",
              "--training.fused_kernels", "false"],
}


def model_folder(tiny: bool, folder: Path) -> list[str]:
    if tiny:
        return ["--model.flavor", "debug", "--model.num_layers", "2"]
    import transformers  # noqa: F401  (hf_config needs it)
    from bench import hf_config

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config("1.5B")).to(torch.bfloat16)
    model.save_pretrained(folder)
    return ["--model.hf_path", str(folder)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="debug model on CPU, 4 steps: checks the script")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--regions", default=REGIONS, help="compile.regions of the regions mode")
    args = p.parse_args()
    MODES["regions"][-1] = args.regions
    if args.tiny:
        shape = ["--job.device", "cpu", "--training.batch_size", "2", "--training.seq_len", "64",
                 "--training.steps", "4", "--compile.backend", "aot_eager"]
    else:
        shape = ["--job.device", "cuda", "--training.batch_size", "4", "--training.seq_len", "4096",
                 "--training.steps", "12", "--training.mixed_precision", "bf16_params"]
    with tempfile.TemporaryDirectory(prefix="exec_bench_model_") as tmp:
        model = model_folder(args.tiny, Path(tmp))
        results = {}
        for mode in args.modes.split(","):
            results[mode] = run_job([*model, *shape, "--data.source", "random", *MODES[mode]], timeout=1800)
            print(f"{mode}: {results[mode]}", flush=True)
    anchor = results.get("none", {}).get("step_s")
    print(f"\n{'mode':8s} {'step ms':>9s} {'vs none':>8s} {'compile s':>10s} {'tokens/s':>10s} {'GiB':>7s}")
    for mode, r in results.items():
        if "error" in r:
            print(f"{mode:8s} {r['error']}")
            continue
        ratio = f"{anchor / r['step_s']:.3f}x" if anchor else "-"
        print(f"{mode:8s} {r['step_s'] * 1e3:9.1f} {ratio:>8s} {r['compile_s']:10.1f} {r['tokens_per_s']:10.0f} "
              f"{r['memory_gib']:7.2f}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The MoE layer comparison at several lengths of sustained work (the H200's power limit shows here).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/moe/block_lengths.py

DeepSeek-V3 expert shapes (bench_setup.py), uniform and skewed routing: dist-moe's fused layer and
the usual pipeline take turns in blocks of 3, 10 and 20 forward+backward steps, each block after
a ~25 ms pause of the GPU (medians over rounds); then both back to back, 10 steps each, twice.
Short blocks run at the clocks of a rested GPU; long ones at those of sustained work, where the
700 W limit lowers the clocks more for the faster pipeline. Prints the usual / fused ratio of each.
Correctness is checked by bench_moe.py's layer section; this only times.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_setup import Setup  # noqa: E402
from layer_sections import LayerCase, baseline_grouped_mm, fused_layer, usual_layer  # noqa: E402


def main() -> None:
    setup = Setup(dry_run=False)
    case = LayerCase(setup)
    gmm, _ = baseline_grouped_mm(setup)
    e = setup.experts
    for routing, ids in case.routings.items():
        steps = {"fused": case.step_of(lambda ids=ids: fused_layer(*case.inputs, ids, e)),
                 "usual": case.step_of(lambda ids=ids: usual_layer(*case.inputs, ids, e, gmm))}
        for step in steps.values():  # compile and tune first
            step()
            step()
        for per_block, rounds in ((3, 8), (10, 4), (20, 3)):
            ms = setup.interleaved_ms(steps, rounds=rounds, per_block=per_block)
            print(f"{routing:8s} blocks of {per_block:2d}: fused {ms['fused']:6.2f} ms, usual {ms['usual']:6.2f} ms, "
                  f"ratio {ms['usual'] / ms['fused']:.3f}", flush=True)
        for _ in range(2):
            ms = {name: setup.time_ms(step, reps=10) for name, step in steps.items()}
            print(f"{routing:8s} back to back: fused {ms['fused']:6.2f} ms, usual {ms['usual']:6.2f} ms, "
                  f"ratio {ms['usual'] / ms['fused']:.3f}", flush=True)


if __name__ == "__main__":
    main()

"""The stability recipe (rl_sorting_stable), shortened: the reward rises while the entropy and the KL to the
starting policy stay bounded, and rl_curve.png shows it.

The run is seeded and on the CPU with one thread (job.device cpu, job.threads 1): a machine with another
instruction set rounds differently and follows another trajectory, so the bounds sit far from what the
seeds measured (SEEDS_MEASURED below), not at one trajectory's values."""
from __future__ import annotations

import math
import statistics
import struct

from titan_train.rl import run_rl
from titan_train.rl.recipes import rl_sorting_stable

# 20 pretraining + 40 RL steps of the recipe, job.seed 0-3, on the shared 2-core machine (~60 s each): sampled
# reward (mean of the first / last 10 steps), greedy reward on 64 held-out problems (before / after), the largest
# 5-step mean KL and the smallest entropy of a step (nats per token).
SEEDS_MEASURED = {
    0: dict(reward=(0.222, 0.356), held_out=(0.245, 0.401), kl=0.575, entropy=0.735),
    1: dict(reward=(0.182, 0.391), held_out=(0.198, 0.437), kl=0.500, entropy=0.935),
    2: dict(reward=(0.242, 0.378), held_out=(0.263, 0.462), kl=0.640, entropy=0.814),
    3: dict(reward=(0.174, 0.348), held_out=(0.208, 0.432), kl=0.612, entropy=0.810),
}
# Bounds well outside those: gains of 0.13-0.21 (sampled) and 0.16-0.24 (held out) against 0.05; KL 0.50-0.64
# against 2; entropy 0.74-0.94 against 0.25. A collapse (entropy to 0, KL running away) or no learning fails them.
REWARD_GAIN, HELD_OUT_GAIN, KL_BOUND, ENTROPY_FLOOR = 0.05, 0.05, 2.0, 0.25


def test_short_stable_run_rises_without_collapse(tmp_path):
    """~60 s on a loaded 2-core machine: fewer steps leave the reward's rise within the batches' noise."""
    config = rl_sorting_stable()
    assert config.job.device == "cpu" and config.job.threads == 1 and config.algorithm.track_kl
    config.job.folder, config.metrics.progress = str(tmp_path), False
    config.pretrain.steps, config.training.steps = 20, 40
    config.eval.problems, config.eval.interval = 64, 0
    result = run_rl(config)
    curve = result.curve
    assert all(math.isfinite(m[k]) for m in curve for k in ("reward_mean", "kl", "entropy", "loss", "clip_frac"))

    rewards = [m["reward_mean"] for m in curve]
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert last > first + REWARD_GAIN, (first, last)
    assert result.evals[40] > result.evals[0] + HELD_OUT_GAIN, result.evals
    kl = [m["kl"] for m in curve]
    assert max(statistics.mean(kl[i:i + 5]) for i in range(len(kl) - 4)) < KL_BOUND, kl
    entropy = [m["entropy"] for m in curve]
    assert min(entropy) > ENTROPY_FLOOR, entropy
    assert max(m["clip_frac"] for m in curve) > 0  # two minibatches per step: the clip is exercised and measured

    png = (tmp_path / "rl_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (640, 640)  # 4 panels of 160

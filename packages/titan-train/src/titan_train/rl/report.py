"""What an RL job shows and saves (rank 0): a progress line per step, `rl_metrics.jsonl` (every metric of
every step, written as it goes), the curve as `rl_curve.csv` and `rl_curve.png`, `rl_summary.json`, and a text
plot."""
from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path

from ..plot import BLUE, GREEN, GREY, RED, write_panels

# The curve's columns: what a reader wants to plot, in this order (every metric is in rl_metrics.jsonl).
CURVE_COLUMNS = ("step", "reward_mean", "reward_std", "eval_reward", "kl", "entropy", "clip_frac", "loss", "staleness",
                 "dropped_samples",
                 "logprob_mismatch_max", "completion_len", "gen_tokens_per_s", "train_tokens_per_s", "seconds")


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e3:.1f}k" if tokens_per_s >= 1e3 else f"{tokens_per_s:.0f}"


class RLProgress:
    """One rewritten line on a terminal; otherwise a line every `log_interval` steps (and the last)."""

    def __init__(self, total: int, *, enabled: bool, log_interval: int, stream=None) -> None:
        self.total, self.enabled, self.log_interval = total, enabled, log_interval
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, m: dict[str, float], eval_reward: float | None) -> None:
        if not self.enabled or not (self.tty or step % self.log_interval == 0 or step == self.total):
            return
        width = 20
        done = int(width * step / max(self.total, 1))
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(step, 1) * (self.total - step)
        evaluated = f"  eval {eval_reward:.3f}" if eval_reward is not None else ""
        line = (f"[{'#' * done}{'.' * (width - done)}] step {step}/{self.total}  reward {m['reward_mean']:.3f}"
                f"{evaluated}  kl {m['kl']:.1e}  entropy {m.get('entropy', 0.0):.2f}"
                f"  mismatch {m['logprob_mismatch_max']:.1e}  stale {int(m['staleness'])}"
                f"  dropped {int(m['dropped_samples_total'])}  gen {_rate(m['gen_tokens_per_s'])} tok/s"
                f"  train {_rate(m['train_tokens_per_s'])} tok/s  {elapsed:.0f}s (eta {eta:.0f}s)")
        self.stream.write("\r\033[K" + line if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


class MetricsFile:
    """<folder>/rl_metrics.jsonl: one JSON record per step, flushed as the run goes."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "rl_metrics.jsonl"
        self._file = open(self.path, "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_curve(path: Path, curve: list[dict[str, float]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CURVE_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for record in curve:
            writer.writerow({k: record.get(k, "") for k in CURVE_COLUMNS})


def write_curve_png(metrics: Path, out: Path) -> None:
    """The run's stability at a glance, each panel on its own scale: sampled reward (blue) with the held-out
    greedy reward (red); KL to the reference (red); entropy (green); clip fraction (grey)."""
    write_panels(metrics, out, [[("reward_mean", BLUE), ("eval_reward", RED)], [("kl", RED)], [("entropy", GREEN)],
                                [("clip_frac", GREY)]], panel_height=160)


def text_plot(values: list[float], *, height: int = 8, width: int = 60, label: str = "reward") -> str:
    """A plain-text plot of `values` (one column per step, or per bucket of steps when there are more than
    `width`; a bucket shows its mean), scaled between the smallest and largest value."""
    if not values:
        return ""
    buckets = max(1, -(-len(values) // width))
    means = [sum(values[i:i + buckets]) / len(values[i:i + buckets]) for i in range(0, len(values), buckets)]
    low, high = min(means), max(means)
    span = high - low or 1.0
    levels = [round((v - low) / span * (height - 1)) for v in means]
    rows = []
    for row in range(height - 1, -1, -1):
        value = low + span * row / (height - 1)
        rows.append(f"{value:7.3f} |" + "".join("*" if level == row else " " for level in levels))
    steps = f"step 1..{len(values)}" + (f", {buckets} steps per column" if buckets > 1 else "")
    rows.append(" " * 8 + "+" + "-" * len(means))
    rows.append(f"{label} per step ({steps})")
    return "\n".join(rows)

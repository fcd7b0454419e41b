"""The rank-0 progress bar: one rewritten line on a terminal, a line per log step otherwise."""
from __future__ import annotations

import sys
import time


def _fmt_rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e3:.1f}k" if tokens_per_s >= 1e3 else f"{tokens_per_s:.0f}"


class ProgressBar:
    def __init__(self, total: int, *, start: int = 0, enabled: bool = True, stream=None):
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, *, loss: float, tokens_per_s: float, mfu: float | None, memory_gib: float,
               mtp_loss: float | None = None) -> None:
        if not self.enabled:
            return
        width = 24
        done = int(width * step / max(self.total, 1))
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(step - self.start, 1) * (self.total - step)
        mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
        mtp_text = f"mtp {mtp_loss:.4f}  " if mtp_loss is not None else ""
        line = (f"[{'#' * done}{'.' * (width - done)}] step {step}/{self.total}  loss {loss:.4f}  {mtp_text}"
                f"{_fmt_rate(tokens_per_s)} tok/s  MFU {mfu_text}  mem {memory_gib:.2f} GiB  "
                f"{elapsed:.0f}s (eta {eta:.0f}s)")
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

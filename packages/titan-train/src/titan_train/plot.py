"""<job.folder>/metrics.png at the end of a run: loss (blue, eval loss red) above, throughput (green) below,
each over the logged steps and scaled to its own range, written at its top and bottom (first and last step
under the axes; every value is in metrics.jsonl and TensorBoard).

Written with zlib alone (a PNG is a zlib-compressed RGB raster plus three chunk headers): a line plot does
not justify a plotting library as a dependency of the trainer."""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

WIDTH, HEIGHT, MARGIN = 640, 480, 16
BLUE, RED, GREEN, GREY = (31, 119, 180), (214, 39, 40), (44, 160, 44), (160, 160, 160)


# 3x5 pixel glyphs (rows top to bottom, 3 bits each) for the axis numbers.
GLYPHS = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7), "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1), "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7),
    ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0), "e": (0, 7, 7, 4, 7), "+": (0, 2, 7, 2, 0), " ": (0, 0, 0, 0, 0),
}
BLACK, SCALE = (40, 40, 40), 2


class Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def line(self, a: tuple[int, int], b: tuple[int, int], color: tuple[int, int, int]) -> None:
        steps = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
        for i in range(steps + 1):
            x, y = a[0] + (b[0] - a[0]) * i / steps, a[1] + (b[1] - a[1]) * i / steps
            self.dot(round(x), round(y), color)
            self.dot(round(x), round(y) + 1, color)  # two pixels thick

    def text(self, x: int, y: int, text: str, color: tuple[int, int, int] = BLACK) -> None:
        """`text` (digits, '.', '-', '+', 'e') with its top-left corner at (x, y), SCALE pixels per glyph dot."""
        for i, char in enumerate(text):
            for row, bits in enumerate(GLYPHS.get(char, GLYPHS[" "])):
                for col in range(3):
                    if bits >> (2 - col) & 1:
                        for dy in range(SCALE):
                            for dx in range(SCALE):
                                self.dot(x + (4 * i + col) * SCALE + dx, y + row * SCALE + dy, color)

    def png(self) -> bytes:
        rows = b"".join(b"\x00" + bytes(self.pixels[3 * y * self.width:3 * (y + 1) * self.width])
                        for y in range(self.height))
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 6))
                + chunk(b"IEND", b""))


def _panel(canvas: Canvas, top: int, bottom: int, series: list[tuple[list[tuple[int, float]], tuple]],
           steps: tuple[int, int]) -> None:
    left, right = MARGIN, canvas.width - MARGIN
    for corner_a, corner_b in (((left, top), (right, top)), ((left, bottom), (right, bottom)),
                               ((left, top), (left, bottom)), ((right, top), (right, bottom))):
        canvas.line(corner_a, corner_b, GREY)
    values = [v for points, _ in series for _, v in points]
    if not values:
        return
    low, high = min(values), max(values)
    canvas.text(left + 4, top + 4, f"{high:.4g}")  # the panel's range, top and bottom
    canvas.text(left + 4, bottom - 4 - 5 * SCALE, f"{low:.4g}")
    span_v, span_s = (high - low) or 1.0, (steps[1] - steps[0]) or 1
    def at(step: int, value: float) -> tuple[int, int]:
        return (round(left + (right - left) * (step - steps[0]) / span_s),
                round(bottom - 4 - (bottom - top - 8) * (value - low) / span_v))
    for points, color in series:
        for p, q in zip(points, points[1:]):
            canvas.line(at(*p), at(*q), color)
        if len(points) == 1:
            x, y = at(*points[0])
            for dx in range(-2, 3):
                canvas.line((x + dx, y - 2), (x + dx, y + 2), color)


Series = tuple[str, tuple[int, int, int]]  # (metric key in the records, line colour)


def write_panels(metrics: Path, out: Path, panels: list[list[Series]], *, panel_height: int = HEIGHT // 2) -> None:
    """A PNG of stacked panels over the steps of the jsonl records in `metrics`, top to bottom; each panel
    draws its series (records without the key are skipped) scaled to the panel's own range."""
    records = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    def series(key: str) -> list[tuple[int, float]]:
        return [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    all_steps = [r["step"] for r in records] or [0]
    steps = (min(all_steps), max(all_steps))
    height = panel_height * len(panels)
    canvas = Canvas(WIDTH, height)
    for i, panel in enumerate(panels):
        top = MARGIN if i == 0 else i * panel_height + MARGIN // 2
        bottom = height - MARGIN if i == len(panels) - 1 else (i + 1) * panel_height - MARGIN // 2
        _panel(canvas, top, bottom, [(series(key), color) for key, color in panel], steps)
    for x, step in ((MARGIN, steps[0]), (WIDTH - MARGIN - 4 * SCALE * len(str(steps[1])), steps[1])):
        canvas.text(x, height - MARGIN + 3, str(step))  # the first and last step, under the axes
    out.write_bytes(canvas.png())


def write_plot(metrics: Path, out: Path) -> None:
    """The training run's plot: loss (blue) and eval loss (red) above, tokens/s (green) below."""
    write_panels(metrics, out, [[("loss", BLUE), ("eval_loss", RED)], [("tokens_per_s", GREEN)]])

"""A one-line progress bar on stderr for long `ferry perf` runs (no dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Call it with the number of requests done; it redraws in place. Bounded by a request count
    (`total`) or by time (`duration_s`)."""

    def __init__(self, label: str, total: int | None = None, duration_s: float | None = None,
                 stream: TextIO = sys.stderr, width: int = 30):
        self.label, self.total, self.duration_s = label, total, duration_s
        self.stream, self.width = stream, width
        self.start = time.perf_counter()

    def __call__(self, done: int) -> None:
        elapsed = time.perf_counter() - self.start
        fractions = [done / self.total if self.total else 0.0, elapsed / self.duration_s if self.duration_s else 0.0]
        fraction = min(max(fractions), 1.0)
        filled = int(fraction * self.width)
        count = f"{done}/{self.total}" if self.total else f"{done}"
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {count} {elapsed:5.1f}s")
        self.stream.flush()

    def close(self, done: int) -> None:
        self(done)
        self.stream.write("\n")
        self.stream.flush()

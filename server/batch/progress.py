"""What a batch run has done so far, drawn on stderr: requests, tokens/s, ETA; one summary line at the end.

On a terminal the line is redrawn in place a few times a second; into a file or pipe a line is
written every `LOG_EVERY_S` seconds instead, so a log stays readable.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

REDRAW_S, LOG_EVERY_S = 0.5, 10.0


@dataclass(slots=True)
class Tally:
    total: int  # requests this run is to answer (those already in OUTPUT are not counted)
    skipped: int = 0  # already answered in OUTPUT by an earlier run
    ok: int = 0  # answered 2xx
    refused: int = 0  # answered with an HTTP error (its line is written)
    unanswered: int = 0  # no HTTP answer (a remote server unreachable): not written, a rerun retries them
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def done(self) -> int:
        return self.ok + self.refused + self.unanswered

    def add(self, status: int, tokens: tuple[int, int]) -> None:
        """One answer: its status and (prompt, completion) token counts."""
        if 200 <= status < 300:
            self.ok += 1
        else:
            self.refused += 1
        self.prompt_tokens += tokens[0]
        self.completion_tokens += tokens[1]

    def merge(self, other: Tally) -> None:
        for name in ("ok", "refused", "unanswered", "prompt_tokens", "completion_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


class Progress:
    def __init__(self, tally: Tally, stream: TextIO = sys.stderr):
        self.tally, self.stream = tally, stream
        self.tty = stream.isatty()
        self.every_s = REDRAW_S if self.tty else LOG_EVERY_S
        self._last = 0.0

    def __call__(self) -> None:
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            self.stream.write(("\r" if self.tty else "") + self._line(now) + ("" if self.tty else "\n"))
            self.stream.flush()

    def _line(self, now: float) -> str:
        t = self.tally
        elapsed = max(now - t.started, 1e-9)
        rate = t.done / elapsed
        eta = _clock((t.total - t.done) / rate) if rate > 0 else "--:--"
        return (f"ferry batch: {t.done}/{t.total} requests, {rate:.1f} req/s, "
                f"{t.completion_tokens / elapsed:.0f} tokens/s, ETA {eta}   ")

    def summary(self, output) -> str:
        t = self.tally
        elapsed = max(time.perf_counter() - t.started, 1e-9)
        line = (f"ferry batch: {t.done} requests in {elapsed:.1f}s ({t.ok} ok, {t.refused} refused, "
                f"{t.unanswered} unanswered; {t.skipped} already in {output}), {t.completion_tokens} tokens generated "
                f"({t.completion_tokens / elapsed:.0f} tokens/s, {t.done / elapsed:.1f} req/s)")
        self.stream.write(("\r" if self.tty else "") + line + "\n")
        self.stream.flush()
        return line


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"

"""Batching windows: how long the oldest request of a group may wait for company.

`FixedWindow` is Triton's `max_queue_delay_microseconds`. `AdaptiveWindow` is Ferry's answer to
"which delay?": given a latency target for queue + compute, it learns the model's execution time
per batch size and the arrival rate online, and waits only while waiting can still pay.

NOTE (the adaptive rule). An instance is free and a group of n rows waits, its oldest queued at t0.
Waiting w more nanoseconds is expected to bring rate * w more rows (up to max_batch_size), so the
instance would serve  rows(w) / (w + exec(rows(w)))  rows per nanosecond over that stretch. The window
closes at the w that maximises this, among w = 0 and fractions of the time the batch needs to fill,
keeping  (now - t0) + w + exec(rows(w)) <= 80% of the target  (the rest is left for transport and
jitter). Consequences: under a burst the batch fills almost at once, so the window is short (and a
full batch leaves immediately anyway); when traffic thins, waiting stops paying (rate * exec(n) < n)
and the batch leaves at once instead of waiting in vain; a closed loop of k clients never waits for
arrivals that only its own answers would trigger. exec() is an exponentially weighted mean per
executed batch size, interpolated between sizes seen and scaled linearly beyond them; with no
measurement yet the window is 0, so the model is measured before anything is held back.
"""

from __future__ import annotations

import bisect

_ALPHA = 0.2  # weight of the newest observation in the moving averages
_TARGET_SHARE = 0.8
_WAIT_SHARES = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)  # candidate waits, as shares of the time to fill the batch


class FixedWindow:
    def __init__(self, delay_ns: int):
        self.delay_ns = delay_ns

    def close_ns(self, head_enqueue_ns: int, rows: int, now_ns: int) -> int:
        return head_enqueue_ns + self.delay_ns

    def on_arrival(self, now_ns: int) -> None:
        pass

    def on_batch(self, rows: int, exec_ns: int) -> None:
        pass

    @property
    def current_ns(self) -> int:
        return self.delay_ns


class ExecTimes:
    """Moving average of execution time per batch size."""

    def __init__(self):
        self._sizes: list[int] = []
        self._ns: dict[int, float] = {}

    def observe(self, rows: int, exec_ns: int) -> None:
        if rows not in self._ns:
            bisect.insort(self._sizes, rows)
            self._ns[rows] = float(exec_ns)
        else:
            self._ns[rows] += _ALPHA * (exec_ns - self._ns[rows])

    def estimate(self, rows: float) -> float:
        if not self._sizes:
            return 0.0
        i = bisect.bisect_left(self._sizes, rows)
        if i < len(self._sizes) and self._sizes[i] == rows:
            return self._ns[self._sizes[i]]
        if i == 0:
            return self._ns[self._sizes[0]]
        if i == len(self._sizes):
            largest = self._sizes[-1]
            return self._ns[largest] * rows / largest
        lo, hi = self._sizes[i - 1], self._sizes[i]
        share = (rows - lo) / (hi - lo)
        return self._ns[lo] + share * (self._ns[hi] - self._ns[lo])


class AdaptiveWindow:
    def __init__(self, target_ns: int, max_batch_size: int):
        self.target_ns = target_ns
        self.max_batch_size = max_batch_size
        self.exec = ExecTimes()
        self._gap_ns: float | None = None  # moving average of the time between arrivals
        self._last_arrival_ns: int | None = None
        self.current_ns = 0  # the last window chosen, for the metrics page

    def on_arrival(self, now_ns: int) -> None:
        if self._last_arrival_ns is not None:
            gap = now_ns - self._last_arrival_ns
            self._gap_ns = gap if self._gap_ns is None else self._gap_ns + _ALPHA * (gap - self._gap_ns)
        self._last_arrival_ns = now_ns

    def on_batch(self, rows: int, exec_ns: int) -> None:
        self.exec.observe(rows, exec_ns)

    def rate_per_ns(self, now_ns: int) -> float:
        if self._gap_ns is None:
            return 0.0
        # A long silence since the last arrival is evidence too: never assume traffic faster than that.
        gap = max(self._gap_ns, now_ns - self._last_arrival_ns, 1.0)
        return 1.0 / gap

    def close_ns(self, head_enqueue_ns: int, rows: int, now_ns: int) -> int:
        rate = self.rate_per_ns(now_ns)
        budget = head_enqueue_ns + self.target_ns * _TARGET_SHARE - now_ns
        best_w, best_score = 0.0, self._score(rows, 0.0)
        if rate > 0 and rows < self.max_batch_size:
            fill = (self.max_batch_size - rows) / rate
            for share in _WAIT_SHARES:
                w = fill * share
                expected = min(self.max_batch_size, rows + rate * w)
                if w + self.exec.estimate(expected) > budget:
                    break
                score = self._score(expected, w)
                if score > best_score:
                    best_w, best_score = w, score
        close = now_ns + int(best_w)
        self.current_ns = max(0, close - head_enqueue_ns)
        return close

    def _score(self, rows: float, wait_ns: float) -> float:
        """Rows served per nanosecond if the batch leaves after `wait_ns`."""
        spent = wait_ns + self.exec.estimate(rows)
        return rows / spent if spent > 0 else float("inf")

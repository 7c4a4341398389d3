"""Batching windows: how long the oldest request of a group may wait for company.

`FixedWindow` is Triton's `max_queue_delay_microseconds`. `AdaptiveWindow` is Ferry's answer to
"which delay?": given a latency target for queue + compute, it learns the model's execution time
per batch size and the arrival rate online, and waits only while waiting can still pay.

NOTE (the adaptive rule). For a group whose oldest request was queued at t0 with n rows waiting:
  expected rows  m = min(max_batch, n + rate * (t0 + target - now))
  latest start   s = t0 + target * 0.8 - exec(m)   (20% of the target is kept for transport and jitter)
  dispatch now   if rate * (s - now) < 1: no further request is expected before the oldest must start,
                 so waiting would be in vain (sparse traffic);
  otherwise      close the window at min(s, now + (max_batch - n) / rate): the moment the batch is
                 expected to be full, or the last moment the oldest request can still meet the target.
A full batch leaves at once regardless (the batcher's rule), so under a burst the window never holds
anything back. exec(m) comes from an exponentially weighted mean per executed batch size,
interpolated between sizes seen and scaled linearly beyond them.
"""

from __future__ import annotations

import bisect

_ALPHA = 0.2  # weight of the newest observation in the moving averages
_TARGET_SHARE = 0.8


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
        deadline = head_enqueue_ns + self.target_ns
        expected = min(self.max_batch_size, rows + rate * max(0, deadline - now_ns))
        latest_start = head_enqueue_ns + int(self.target_ns * _TARGET_SHARE - self.exec.estimate(expected))
        if rate * (latest_start - now_ns) < 1:
            close = now_ns
        else:
            close = min(latest_start, now_ns + int((self.max_batch_size - rows) / rate))
        self.current_ns = max(0, close - head_enqueue_ns)
        return close

"""How busy the event loop is: the share of wall time it spends running callbacks, not waiting for I/O.

Every request's gRPC decode and encode runs on the one event loop, so on a light model the loop, not
the instance, is what bounds throughput. Its load is what an adaptive batching window must see to
know that a bigger batch (one dispatch, one executor hop and one wake-up for many rows) frees the
bottleneck. Measured here, at the runner's level, and handed to the pure policy as a number.

How: asyncio's selector loop blocks in `selector.select(timeout)` exactly when it has nothing to run.
The selector is wrapped so each call adds the time it blocked; every `interval_s` the idle share of
that interval is folded into a moving average. The cost is two clock reads per loop iteration. A loop
that is not a selector loop (uvloop, the Windows proactor) is not measured: `busy_ratio` stays None,
and the policy then decides as it would without the signal.
"""

from __future__ import annotations

import asyncio
import time
from asyncio.selector_events import BaseSelectorEventLoop

_ALPHA = 0.5  # weight of the newest interval: the figure follows a change of load within ~0.3 s


class _TimedSelector:
    """The loop's own selector, counting the time spent blocked in select()."""

    def __init__(self, inner):
        self.inner = inner
        self.idle_ns = 0

    def select(self, timeout=None):
        start = time.monotonic_ns()
        try:
            return self.inner.select(timeout)
        finally:
            self.idle_ns += time.monotonic_ns() - start

    def __getattr__(self, name):  # register, modify, unregister, get_key, get_map, close
        return getattr(self.inner, name)


class LoopLoad:
    """The busy share of one event loop, refreshed every `interval_s` on that loop; read from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = 0.1):
        self.busy_ratio: float | None = None  # None: not measured (yet, or not measurable on this loop)
        self.intervals = 0  # intervals measured so far
        self._loop, self._interval_s = loop, interval_s
        self._selector: _TimedSelector | None = None
        self._handle: asyncio.TimerHandle | None = None
        if isinstance(loop, BaseSelectorEventLoop):
            self._selector = _TimedSelector(loop._selector)
            loop._selector = self._selector
            self._since_ns, self._idle_at_since = time.monotonic_ns(), 0
            self._handle = loop.call_later(interval_s, self._tick)

    def _tick(self) -> None:
        now, idle = time.monotonic_ns(), self._selector.idle_ns
        elapsed = now - self._since_ns
        if elapsed > 0:
            busy = min(1.0, max(0.0, 1.0 - (idle - self._idle_at_since) / elapsed))
            self.busy_ratio = busy if self.busy_ratio is None else self.busy_ratio + _ALPHA * (busy - self.busy_ratio)
            self.intervals += 1
        self._since_ns, self._idle_at_since = now, idle
        self._handle = self._loop.call_later(self._interval_s, self._tick)

    def close(self) -> None:
        """Stop measuring and give the loop its own selector back."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._selector is not None and self._loop._selector is self._selector:
            self._loop._selector = self._selector.inner
        self._selector = None

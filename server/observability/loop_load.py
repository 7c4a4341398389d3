"""How busy the event loop is: the share of wall time its thread runs or waits for a core, not for I/O.

Every request's gRPC decode and encode runs on the one event loop, so on a light model the loop, not
the instance, is what bounds throughput. Its load is what an adaptive batching window must see to
know that a bigger batch (one dispatch, one executor hop and one wake-up for many rows) frees the
bottleneck. Measured here, at the runner's level, and handed to the pure policy as a number.

How: a timer on the loop reads its own thread's scheduler statistics every `interval_s`
(/proc/thread-self/schedstat: time on a core, and time runnable but waiting for one). A loop with
nothing to do sleeps in its poller and accrues neither, whichever loop it is (asyncio's own, uvloop),
so the two together over the interval are its busy share. Waiting for a core counts as busy: a
loop that is ready to run on a machine whose cores are taken is just as much the bottleneck. Where
Linux's statistics are missing, the thread's CPU time alone is used, which reads somewhat lower under
contention. The cost is one small file read per interval.
"""

from __future__ import annotations

import asyncio
import time

_ALPHA = 0.5  # weight of the newest interval: the figure follows a change of load within ~0.3 s
_SCHEDSTAT = "/proc/thread-self/schedstat"


def _thread_busy_ns() -> int:
    """This thread's time on a core plus time runnable without one, so far (ns)."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            on_cpu, waiting, _ = f.read().split()
        return int(on_cpu) + int(waiting)
    except (OSError, ValueError):
        return time.thread_time_ns()


class LoopLoad:
    """The busy share of one event loop, refreshed every `interval_s` on that loop; read from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = 0.1):
        self.busy_ratio: float | None = None  # None: not measured yet
        self.intervals = 0  # intervals measured so far
        self._loop, self._interval_s = loop, interval_s
        self._since_ns: int | None = None
        self._busy_at_since = 0
        self._handle: asyncio.TimerHandle | None = loop.call_soon(self._tick)

    def _tick(self) -> None:
        """On the loop's own thread, so the statistics read are the loop's."""
        now, busy_ns = time.monotonic_ns(), _thread_busy_ns()
        if self._since_ns is not None and now > self._since_ns:
            busy = min(1.0, max(0.0, (busy_ns - self._busy_at_since) / (now - self._since_ns)))
            self.busy_ratio = busy if self.busy_ratio is None else self.busy_ratio + _ALPHA * (busy - self.busy_ratio)
            self.intervals += 1
        self._since_ns, self._busy_at_since = now, busy_ns
        self._handle = self._loop.call_later(self._interval_s, self._tick)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

"""Batching windows: how long the oldest request of a group may wait for company.

`FixedWindow` is Triton's `max_queue_delay_microseconds`. `AdaptiveWindow` is Ferry's answer to
"which delay?": given a latency target for queue + compute, it learns the model's execution time
per batch size and the arrival rate online, and waits only while waiting can still pay.

NOTE (the adaptive rule). An instance is free; a group of n rows waits, its oldest queued at t0.
  * Who else can come? Ferry tracks the requests in the system (queued + executing) and their recent
    peak, the apparent concurrency C (it rises at once and halves every 100 ms without a new peak).
    If everyone recently seen is already waiting here (C - in_system < 1), nobody else is coming
    soon: dispatch now. This is what keeps a closed loop of k clients from waiting for arrivals that
    only its own answers trigger. Likewise when no request came for eight mean gaps: the stream
    paused. (Not fewer: one Poisson gap in seven is twice the mean, and a closed loop's answers come
    back in clumps, so a short lull is normal; ending windows on it cut batches of 1-5 rows between
    the real ones and broke the clients into ragged cohorts.)
  * Otherwise e = min(C - in_system, max_batch_size - n) more rows are expected, at the observed
    arrival rate r, within w = e / r. Is waiting worth it? The instance's load at that batch size is
    R * exec(n + e) / (n + e), with R the arrival rate over the last second (its last 1024 arrivals at
    most: a pause before them, however long, does not count, and clumps average out). Below
    1/2 the instance has slack (the server's bottleneck is elsewhere, e.g. per-request work on the
    CPU), so a larger batch costs no instance time and saves per-batch work.
    Even then it waits only if the batch would grow by a quarter (e >= n / 4): the per-batch saving fades
    as batches grow, and waiting for the last stragglers of a closed loop costs more than it saves.
    At 1/2 or more the instance is the bottleneck and idling it costs throughput: wait only if it
    serves clearly more rows per unit time, (n + e) / (w + exec(n + e)) > 1.1 * n / exec(n), as on a
    GPU whose batch costs the same at any size. (The 10% margin: where rows cost about the same in any
    batch, as on a CPU, the two sides differ by the noise in exec(), and waiting on noise idles the
    instance for nothing.)
  * Never wait past  t0 + 0.8 * target - exec(n + e): the oldest request must still meet the target
    (20% of it is left for transport and jitter). Sparse traffic (r * remaining budget < 1) or no
    execution measurement yet: dispatch now, so nothing waits in vain and the model is measured first.
  * The front end (the one event loop doing every request's gRPC decode and encode) is seen through
    one number the runner hands in: the loop's busy share B (server/observability/loop_load.py). At B >= 0.85 the
    loop is the bottleneck, and the wait changes as follows (the load test above still comes first:
    an instance at load >= 1/2 waits only for a clear gain in rows per unit time, whatever B).
    Requests waiting for the loop are invisible here (they are inside gRPC's core or the client, not
    in a handler: counted at dispatch, calls between the gRPC interceptor and the queue were 0-0.3 on
    average), so C undercounts the clients: from four queued rows on, at least a quarter more
    (rounded up) are expected whatever C says, and a lone client is never held. With slack on the
    instance such a wait always counts as worth it: it frees loop time (one dispatch, executor hop
    and wake-up for many rows) and costs no instance time. The cap of four executions is replaced by
    a share of the target: the oldest request waits here at most a fifth of it (10 ms of 50),
    because the same requests also queue in front of the loop, where no window can see them (at 128
    clients a round trip takes at least 128 / 3,600 req/s = 35 ms even on the bare gRPC floor,
    nearly all of it waiting for the loop). Every arrival reopens the question, so such a window runs
    on while the loop keeps delivering rows and ends at that share, or at a silence of two mean gaps
    (the loop paces the arrivals, so a short silence means everyone is here; waiting longer would
    idle the loop itself). B < 0.85, or no measurement (a loop that cannot be measured): the rules
    above, unchanged, so a lone client or a quiet server still gets its batch at once.
A full batch always leaves at once (the batcher's rule). exec() is an exponentially weighted mean per
executed batch size of what the batch cost its instance (assembly plus the run on its thread; not the
wall time until the loop took the answer, which on a busy loop adds the loop's lag and made a light
model look compute bound), interpolated between sizes seen and scaled linearly beyond them.
"""

from __future__ import annotations

import bisect
from collections import deque

_ALPHA = 0.2  # weight of the newest observation in the moving averages
_RATE_WINDOW_NS = 1_000_000_000  # the sustained arrival rate is counted over this much recent time
_RATE_SAMPLES = 1024  # ... and over at most this many arrivals
_TARGET_SHARE = 0.8
_BOTTLENECK_LOAD = 0.5  # instance load above which idling it costs throughput
_MIN_GAIN = 1.1  # a bottleneck instance waits only for at least this much more rows per unit time
_MIN_GROWTH = 0.25  # with slack, wait only if the batch would grow by at least a quarter
_PEAK_HALF_LIFE_NS = 100_000_000  # how fast the apparent concurrency forgets an old peak
_WAIT_EXEC_RATIO = 4.0  # never wait longer than this many executions of the grown batch
_FRONTEND_BUSY = 0.85  # event loop busy share from which the front end counts as the bottleneck; then:
_FRONTEND_MIN_ROWS = 4  # from this many queued rows, at least a quarter more are expected (a lone client is never held)
_FRONTEND_WAIT_SHARE = 0.2  # the oldest request waits here for at most this share of the target
_FRONTEND_PAUSE_GAPS = 2.0  # and a silence this many mean gaps long ends the window (the loop paces arrivals)
_PAUSE_GAPS = 8.0  # no arrival for this many mean gaps: the stream paused (a Poisson gap that long: 1 in 3000)


class FixedWindow:
    def __init__(self, delay_ns: int):
        self.delay_ns = delay_ns

    def close_ns(self, head_enqueue_ns: int, rows: int, now_ns: int, in_system: int) -> int:
        return head_enqueue_ns + self.delay_ns

    def on_arrival(self, now_ns: int, in_system: int) -> None:
        pass

    def still_expecting(self, rows: int, in_system: int, now_ns: int) -> bool:
        return True

    def pause_ns(self, rows: int) -> int | None:
        return None

    def on_batch(self, rows: int, exec_ns: int) -> None:
        pass

    def on_frontend(self, busy_ratio: float | None) -> None:
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

    @property
    def known(self) -> bool:
        return bool(self._sizes)

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
        self._recent: deque[int] = deque(maxlen=_RATE_SAMPLES)  # arrival times in the rate window
        self._last_arrival_ns: int | None = None
        self.concurrency = 0.0  # apparent concurrency: recent peak of requests in the system
        self.current_ns = 0  # the last window chosen, for the metrics page
        self.frontend_busy: float | None = None  # the front end's event loop: share of time busy (None: unknown)

    def on_arrival(self, now_ns: int, in_system: int) -> None:
        decay = 1.0
        if self._last_arrival_ns is not None:
            gap = now_ns - self._last_arrival_ns
            self._gap_ns = gap if self._gap_ns is None else self._gap_ns + _ALPHA * (gap - self._gap_ns)
            decay = 0.5 ** (gap / _PEAK_HALF_LIFE_NS)
        self._last_arrival_ns = now_ns
        self.concurrency = max(float(in_system), self.concurrency * decay)
        recent = self._recent
        recent.append(now_ns)
        while recent[0] < now_ns - _RATE_WINDOW_NS:
            recent.popleft()

    def still_expecting(self, rows: int, in_system: int, now_ns: int) -> bool:
        """Whether more rows are still expected for a group of `rows` that is waiting (close_ns's first
        tests, without the rest): the batcher asks this per arrival and the whole question only when a
        window opens or closes, so an arrival costs a comparison, not a decision (nor a new timer)."""
        expected = self.concurrency - in_system
        frontend_bound = self.frontend_busy is not None and self.frontend_busy >= _FRONTEND_BUSY
        if frontend_bound and rows >= _FRONTEND_MIN_ROWS:
            expected = max(expected, -(-rows // 4))
        if min(expected, self.max_batch_size - rows) < 1:
            return False
        gap = self._gap_ns
        return gap is None or now_ns - self._last_arrival_ns <= (_FRONTEND_PAUSE_GAPS if frontend_bound else _PAUSE_GAPS) * gap

    def pause_ns(self, rows: int) -> int | None:
        """When a group of `rows` should look again for a silence that ends its window (the loop-bound rule:
        a silence of two mean gaps means everyone is here, and an idle loop must not wait out the window);
        None where that rule does not apply. The batcher sets no timer per arrival for it: a look that finds
        the rows still coming keeps the window and sets the next look from the latest arrival. Looks come
        every quarter of the rows in gaps (at least two gaps): a look every two gaps cost a turn of the runner
        per arrival, and a quarter of the rows is the silence the window waited for when it was decided per
        arrival (its close then moved to the latest arrival plus the quarter still expected)."""
        if rows < _FRONTEND_MIN_ROWS or self._gap_ns is None or self.frontend_busy is None or self.frontend_busy < _FRONTEND_BUSY:
            return None
        return int(self._last_arrival_ns + max(_FRONTEND_PAUSE_GAPS, rows / 4) * self._gap_ns) + 1

    def _sustained_rate(self) -> float:
        recent = self._recent
        if len(recent) < 2:
            return 0.0
        return (len(recent) - 1) / max(recent[-1] - recent[0], 1)

    def on_batch(self, rows: int, exec_ns: int) -> None:
        self.exec.observe(rows, exec_ns)

    def on_frontend(self, busy_ratio: float | None) -> None:
        self.frontend_busy = busy_ratio

    def rate_per_ns(self, now_ns: int) -> float:
        if self._gap_ns is None:
            return 0.0
        # A long silence since the last arrival is evidence too: never assume traffic faster than that.
        gap = max(self._gap_ns, now_ns - self._last_arrival_ns, 1.0)
        return 1.0 / gap

    def close_ns(self, head_enqueue_ns: int, rows: int, now_ns: int, in_system: int) -> int:
        close = now_ns
        frontend_bound = self.frontend_busy is not None and self.frontend_busy >= _FRONTEND_BUSY
        expected = self.concurrency - in_system
        if frontend_bound and rows >= _FRONTEND_MIN_ROWS:
            # Clients queued in the front end are invisible here: expect at least a quarter more (rounded
            # up: rounding down held back every batch whose size is not a multiple of four).
            expected = max(expected, -(-rows // 4))
        expected = min(expected, self.max_batch_size - rows)
        rate = self.rate_per_ns(now_ns)
        # With the loop busy, arrivals are paced by it: a short silence means everyone is already here.
        pause_gaps = _FRONTEND_PAUSE_GAPS if frontend_bound else _PAUSE_GAPS
        paused = self._gap_ns is not None and now_ns - self._last_arrival_ns > pause_gaps * self._gap_ns
        if expected >= 1 and rate > 0 and not paused and self.exec.known and self._worth_waiting(rows, expected, rate, frontend_bound):
            exec_grown = self.exec.estimate(rows + expected)
            latest_start = head_enqueue_ns + self.target_ns * _TARGET_SHARE - exec_grown
            if rate * (latest_start - now_ns) >= 1:
                close = int(min(latest_start, now_ns + expected / rate))
                if frontend_bound:
                    # Requests also queue in front of the loop, unseen here: leave them most of the target.
                    close = int(min(close, head_enqueue_ns + _FRONTEND_WAIT_SHARE * self.target_ns))
                else:
                    # Waiting much longer than the grown batch takes to run rarely pays: if the expected
                    # rows are that slow, the expectation is probably wrong.
                    close = int(min(close, now_ns + _WAIT_EXEC_RATIO * exec_grown))
        self.current_ns = max(0, close - head_enqueue_ns)
        return max(close, now_ns)

    def _worth_waiting(self, rows: int, expected: float, rate: float, frontend_bound: bool) -> bool:
        grown = rows + expected
        exec_grown = self.exec.estimate(grown)
        sustained_rate = self._sustained_rate()  # a lull right now does not make the instance idle
        if sustained_rate * exec_grown / grown < _BOTTLENECK_LOAD:
            # The instance has slack: a bigger batch only saves per-batch work, and that saving fades
            # as the batch grows, so wait only for a real increase, not for the last stragglers; unless
            # the loop is the bottleneck, where every batch saved is loop time for more requests.
            return frontend_bound or expected >= rows * _MIN_GROWTH
        wait = expected / rate
        return grown / (wait + exec_grown) > _MIN_GAIN * rows / max(self.exec.estimate(rows), 1.0)

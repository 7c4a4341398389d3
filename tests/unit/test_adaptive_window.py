"""The adaptive window as a pure function of time and observations."""

from __future__ import annotations

from server.scheduling.adaptive import AdaptiveWindow, ExecTimes

MS = 1_000_000
US = 1_000


def window_after(gap_ns: int, target_ms: float = 20, rows: int = 1, max_batch: int = 32, exec_ms: float = 1):
    """A window that has seen 50 arrivals `gap_ns` apart and batches taking `exec_ms` per batch."""
    w = AdaptiveWindow(int(target_ms * MS), max_batch)
    w.on_batch(1, int(exec_ms * MS))
    w.on_batch(max_batch, int(exec_ms * 4 * MS))
    now = 0
    for _ in range(50):
        w.on_arrival(now)
        now += gap_ns
    now -= gap_ns
    return w, now, w.close_ns(now, rows, now) - now


def test_exec_times_interpolate_and_extrapolate():
    e = ExecTimes()
    e.observe(1, 1000)
    e.observe(9, 5000)
    assert e.estimate(1) == 1000 and e.estimate(5) == 3000 and e.estimate(18) == 10000
    e.observe(1, 2000)
    assert 1000 < e.estimate(1) < 2000  # a moving average, not the last value


def test_burst_closes_the_window_almost_at_once():
    _, _, wait = window_after(gap_ns=10 * US)  # 100k requests/s: 31 more rows in 0.31 ms
    assert 0 < wait <= 0.5 * MS


def test_window_grows_as_traffic_thins_but_stays_within_target():
    waits = [window_after(gap_ns=g)[2] for g in (10 * US, 200 * US, 1 * MS)]
    assert waits[0] < waits[1] < waits[2]
    assert waits[2] <= 0.8 * 20 * MS  # the oldest request still starts within 80% of its target


def test_sparse_traffic_does_not_wait_in_vain():
    _, _, wait = window_after(gap_ns=50 * MS)  # one request every 50 ms, target 20 ms: nobody is coming
    assert wait == 0


def test_silence_lowers_the_rate_estimate():
    w, now, _ = window_after(gap_ns=100 * US)
    busy = w.rate_per_ns(now)
    assert w.rate_per_ns(now + 1000 * MS) < busy / 100
    assert w.close_ns(now + 1000 * MS, 1, now + 1000 * MS) == now + 1000 * MS  # dispatch at once


def test_slow_model_leaves_less_time_to_wait():
    fast = window_after(gap_ns=1 * MS, exec_ms=1)[2]
    slow = window_after(gap_ns=1 * MS, exec_ms=3)[2]
    assert slow < fast

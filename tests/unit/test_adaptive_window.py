"""The adaptive window as a pure function of time and observations."""

from __future__ import annotations

from server.scheduling.adaptive import AdaptiveWindow, ExecTimes

MS = 1_000_000
US = 1_000


def window(gap_ns: int, exec_1_ms: float, exec_32_ms: float, target_ms: float = 50, rows: int = 1):
    """The window chosen after 50 arrivals `gap_ns` apart, for a model with the given execution times."""
    w = AdaptiveWindow(int(target_ms * MS), 32)
    w.on_batch(1, int(exec_1_ms * MS))
    w.on_batch(32, int(exec_32_ms * MS))
    now = 0
    for _ in range(50):
        w.on_arrival(now)
        now += gap_ns
    now -= gap_ns
    return w.close_ns(now, rows, now) - now


def test_exec_times_interpolate_and_extrapolate():
    e = ExecTimes()
    e.observe(1, 1000)
    e.observe(9, 5000)
    assert e.estimate(1) == 1000 and e.estimate(5) == 3000 and e.estimate(18) == 10000
    e.observe(1, 2000)
    assert 1000 < e.estimate(1) < 2000  # a moving average, not the last value


def test_burst_on_a_flat_cost_model_waits_only_until_the_batch_fills():
    wait = window(gap_ns=10 * US, exec_1_ms=1, exec_32_ms=1.2)  # 31 more rows arrive in 0.31 ms
    assert 0 < wait <= 0.31 * MS


def test_window_grows_as_traffic_thins_while_waiting_still_pays():
    fast = window(gap_ns=10 * US, exec_1_ms=1, exec_32_ms=1.2)
    slower = window(gap_ns=100 * US, exec_1_ms=1, exec_32_ms=1.2)
    assert 0 < fast < slower <= 3.1 * MS


def test_sparse_traffic_does_not_wait_in_vain():
    assert window(gap_ns=50 * MS, exec_1_ms=1, exec_32_ms=1.2) == 0


def test_cheap_rows_dispatch_at_once_so_a_closed_loop_is_not_held():
    # one client in a closed loop: its next request only comes after this answer, so waiting never pays
    assert window(gap_ns=500 * US, exec_1_ms=0.1, exec_32_ms=3.2) == 0


def test_the_oldest_request_keeps_its_latency_budget():
    # filling the batch would take 15.5 ms; with a 20 ms target only 16 ms minus execution may be spent
    unbounded = window(gap_ns=500 * US, exec_1_ms=1, exec_32_ms=1.2, target_ms=1000)
    bounded = window(gap_ns=500 * US, exec_1_ms=1, exec_32_ms=1.2, target_ms=20)
    assert unbounded >= 15.5 * MS
    assert 0 < bounded < 15.5 * MS and bounded + 1.2 * MS <= 0.8 * 20 * MS


def test_no_measurement_yet_means_no_waiting():
    w = AdaptiveWindow(50 * MS, 32)
    for t in range(0, 50 * US, US):
        w.on_arrival(t)
    assert w.close_ns(50 * US, 1, 50 * US) == 50 * US

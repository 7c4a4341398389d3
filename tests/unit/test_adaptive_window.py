"""The adaptive window as a pure function of time and observations."""

from __future__ import annotations

from server.scheduling.adaptive import AdaptiveWindow, ExecTimes

MS = 1_000_000
US = 1_000


def window(gap_ns: int, clients: int, waiting: int, target_ms: float = 50, exec_1_ms=1.0, exec_32_ms=1.2):
    """The window chosen for `waiting` queued rows after arrivals `gap_ns` apart from `clients` clients."""
    w = AdaptiveWindow(int(target_ms * MS), 32)
    w.on_batch(1, int(exec_1_ms * MS))
    w.on_batch(32, int(exec_32_ms * MS))
    now = 0
    for i in range(50):
        w.on_arrival(now, in_system=min(clients, i + 1))
        now += gap_ns
    now -= gap_ns
    return w.close_ns(now, waiting, now, in_system=waiting) - now


def test_exec_times_interpolate_and_extrapolate():
    e = ExecTimes()
    e.observe(1, 1000)
    e.observe(9, 5000)
    assert e.estimate(1) == 1000 and e.estimate(5) == 3000 and e.estimate(18) == 10000
    e.observe(1, 2000)
    assert 1000 < e.estimate(1) < 2000  # a moving average, not the last value


def test_burst_waits_only_until_the_expected_rows_arrive():
    wait = window(gap_ns=10 * US, clients=32, waiting=1)  # 31 more rows expected within 0.31 ms
    assert 0 < wait <= 0.31 * MS


def test_window_grows_as_traffic_thins():
    fast = window(gap_ns=10 * US, clients=32, waiting=1)
    slower = window(gap_ns=200 * US, clients=32, waiting=1)
    assert 0 < fast < slower <= 0.8 * 50 * MS


def test_sparse_traffic_does_not_wait_in_vain():
    assert window(gap_ns=50 * MS, clients=32, waiting=1) == 0


def test_closed_loop_whose_clients_all_wait_is_not_held():
    # one client, or every recent client already queued: nobody else can arrive before we answer
    assert window(gap_ns=500 * US, clients=1, waiting=1) == 0
    assert window(gap_ns=50 * US, clients=8, waiting=8) == 0
    assert window(gap_ns=50 * US, clients=8, waiting=4) > 0  # four answers are on their way back


def test_the_oldest_request_keeps_its_latency_budget():
    # 31 more rows at one per ms would take 31 ms; with a 20 ms target only 16 ms minus execution remain
    bounded = window(gap_ns=1 * MS, clients=32, waiting=1, target_ms=20, exec_1_ms=5, exec_32_ms=6)
    assert 0 < bounded and bounded + 6 * MS <= 0.8 * 20 * MS
    assert window(gap_ns=1 * MS, clients=32, waiting=1, target_ms=1000, exec_1_ms=5, exec_32_ms=6) > bounded


def test_never_waits_much_longer_than_the_batch_takes_to_run():
    # a cheap model: filling the batch would take 31 ms, but running it takes 1.2 ms
    wait = window(gap_ns=1 * MS, clients=32, waiting=1, target_ms=1000, exec_1_ms=1, exec_32_ms=1.2)
    assert 0 < wait <= 4 * 1.2 * MS


def test_a_paused_stream_is_not_waited_for():
    w = AdaptiveWindow(50 * MS, 32)
    w.on_batch(1, MS)
    w.on_batch(32, int(1.2 * MS))
    for i in range(20):
        w.on_arrival(i * 100 * US, in_system=i + 1)  # 20 clients seen, one arrival every 0.1 ms
    last = 19 * 100 * US
    assert w.close_ns(last, 1, last, in_system=1) > last  # right after an arrival: more are expected
    lull = last + 300 * US  # three mean gaps: one Poisson gap in twenty is that long, not a pause
    assert w.close_ns(last, 1, lull, in_system=1) > lull
    later = last + 1 * MS  # ten mean gaps of silence: the stream paused
    assert w.close_ns(last, 1, later, in_system=1) == later


def test_no_measurement_yet_means_no_waiting():
    w = AdaptiveWindow(50 * MS, 32)
    for i, t in enumerate(range(0, 50 * US, US)):
        w.on_arrival(t, in_system=i + 1)
    assert w.close_ns(50 * US, 1, 50 * US, in_system=1) == 50 * US


def test_compute_bound_instance_is_not_left_idle_for_a_bigger_batch():
    # 1.25 ms per row whatever the batch, 0.6 rows per ms arriving: the instance is the bottleneck and
    # waiting 27 ms for 16 more rows would serve fewer rows per second than running the 16 now
    assert window(gap_ns=1_667 * US, clients=64, waiting=16, target_ms=500, exec_1_ms=1.25, exec_32_ms=40) == 0


def compute_bound_window() -> tuple[AdaptiveWindow, int]:
    """1.25 ms per row whatever the batch, 50 arrivals 1.667 ms apart from up to 64 clients: the
    instance is the bottleneck. Returns the window and the time after the last arrival's gap."""
    w = AdaptiveWindow(500 * MS, 32)
    w.on_batch(1, int(1.25 * MS))
    w.on_batch(32, 40 * MS)
    now = 0
    for i in range(50):
        w.on_arrival(now, in_system=min(64, i + 1))
        now += 1_667 * US
    return w, now


def test_an_idle_spell_does_not_make_a_busy_instance_look_idle():
    # as above, but the model sat idle for ten seconds before this traffic: the pause is not a rate
    w, now = compute_bound_window()
    now += 10_000 * MS
    for i in range(50):
        w.on_arrival(now, in_system=min(64, i + 1))
        now += 1_667 * US
    now -= 1_667 * US
    assert w.close_ns(now, 16, now, in_system=16) == now


def test_sustained_rate_is_the_true_mean_of_clumped_arrivals():
    # a closed loop's requests come back a batch at a time: 32 at once, then a 40 ms lull
    w = AdaptiveWindow(50 * MS, 32)
    now = 0
    for _ in range(20):
        for _ in range(32):
            w.on_arrival(now, in_system=1)
            now += 30 * US
        now += 40 * MS - 30 * US
    true_rate = 32 / (31 * 30 * US + 40 * MS)
    assert abs(w._sustained_rate() / true_rate - 1) < 0.1


def saturated(busy: float | None, clients_seen: int, waiting: int, target_ms: float = 50, gap_ns: int = 400 * US):
    """A light model (1 ms for 1 row, 1.2 ms for 32) at 2,500 req/s; the recent peak of requests in the
    scheduler was `clients_seen` (the rest of the clients wait for the event loop, unseen here)."""
    w = AdaptiveWindow(int(target_ms * MS), 128)
    w.on_batch(1, MS)
    w.on_batch(32, int(1.2 * MS))
    now = 0
    for i in range(200):
        w.on_arrival(now, in_system=min(clients_seen, i % clients_seen + 1))
        now += gap_ns
    now -= gap_ns
    w.on_frontend(busy)
    return w, now


def test_busy_front_end_waits_for_more_rows_than_the_scheduler_sees():
    # 16 queued, and 16 was the peak seen: without the loop's signal nobody else is expected
    w, now = saturated(busy=0.3, clients_seen=16, waiting=16)
    assert w.close_ns(now, 16, now, in_system=16) == now
    w.on_frontend(None)  # an unmeasured loop: the same
    assert w.close_ns(now, 16, now, in_system=16) == now
    w.on_frontend(0.95)  # the loop is the bottleneck: clients are queued in front of it, wait for them
    assert w.close_ns(now, 16, now, in_system=16) > now


def test_busy_front_end_waits_longer_than_four_executions():
    idle, now = saturated(busy=0.3, clients_seen=64, waiting=8, target_ms=200)
    busy, _ = saturated(busy=0.95, clients_seen=64, waiting=8, target_ms=200)
    exec_grown = idle.exec.estimate(64)
    assert 0 < idle.close_ns(now, 8, now, in_system=8) - now <= 4 * exec_grown
    assert busy.close_ns(now, 8, now, in_system=8) - now > 4 * exec_grown


def test_busy_front_end_holds_the_oldest_for_at_most_a_fifth_of_the_target():
    # 56 more rows expected at 2.5 per ms would take 22 ms; requests also queue in front of the loop,
    # unseen here, so the window leaves them most of the 50 ms: at most 10 ms since the oldest came
    w, now = saturated(busy=0.95, clients_seen=64, waiting=8)
    assert w.close_ns(now, 8, now, in_system=8) == now + 10 * MS
    head = now - 4 * MS  # the oldest has waited 4 ms already
    assert w.close_ns(head, 8, now, in_system=8) == head + 10 * MS
    late = head + 10 * MS + 1  # its share is spent: dispatch
    assert w.close_ns(head, 8, late, in_system=8) == late


def test_busy_front_end_never_waits_past_the_target():
    # a target so tight that its last useful start comes before a fifth of it
    w, now = saturated(busy=1.0, clients_seen=64, waiting=8, target_ms=3)
    close = w.close_ns(now, 8, now, in_system=8)
    assert now <= close <= now + 0.8 * 3 * MS - w.exec.estimate(8)
    late = now + 2 * MS  # past the last useful start: no more waiting
    assert w.close_ns(now, 8, late, in_system=8) == late


def test_busy_front_end_expects_growth_for_every_batch_size():
    # The scheduler saw exactly the rows that wait (nobody else expected from the apparent concurrency);
    # a quarter more, rounded up, is expected whatever the size (rounded down, sizes that are not a
    # multiple of four never waited: light model, 64 clients, batches stuck at the loop's own lag).
    for rows in range(8, 100):  # (below 8 rows, a 1 ms run per batch at 2,500 rows/s is half the instance)
        w, now = saturated(busy=0.95, clients_seen=rows, waiting=rows)
        assert w.close_ns(now, rows, now, in_system=rows) > now, rows
    for rows in (1, 2, 3):  # fewer than four: the apparent concurrency alone decides, as when the loop is idle
        w, now = saturated(busy=0.95, clients_seen=rows, waiting=rows)
        assert w.close_ns(now, rows, now, in_system=rows) == now, rows


def test_busy_front_end_keeps_waiting_while_the_loop_delivers_rows():
    # every arrival re-opens the question; the window ends at the oldest request's share of the target
    w, now = saturated(busy=0.95, clients_seen=10, waiting=10)
    head, rows = now, 10
    while True:
        close = w.close_ns(head, rows, now, in_system=rows)
        if close == now:
            break
        assert close <= head + 10 * MS
        now += 400 * US  # the loop hands over one more request per mean gap
        rows += 1
        w.on_arrival(now, in_system=rows)
    assert now >= head + 10 * MS and rows == 10 + 25  # one row per 0.4 ms for the 10 ms share


def test_busy_front_end_still_answers_a_lone_client_at_once():
    w, now = saturated(busy=1.0, clients_seen=1, waiting=1, gap_ns=2 * MS)
    assert w.close_ns(now, 1, now, in_system=1) == now  # a quarter of one row is no row: nobody to wait for


def test_busy_front_end_ends_the_window_after_a_short_silence():
    w, now = saturated(busy=0.95, clients_seen=64, waiting=32)
    assert w.close_ns(now, 32, now + 500 * US, in_system=32) > now + 500 * US  # about one gap: keep waiting
    later = now + 1_000 * US  # two and a half mean gaps without an arrival, the loop pacing them: all are here
    assert w.close_ns(now, 32, later, in_system=32) == later


def test_busy_front_end_does_not_idle_a_compute_bound_instance():
    # the instance is the bottleneck (1.25 ms per row, 0.6 rows per ms): the loop's load changes nothing
    w, now = compute_bound_window()
    now -= 1_667 * US
    w.on_frontend(1.0)
    assert w.close_ns(now, 16, now, in_system=16) == now


def test_heavy_model_with_flat_rows_per_second_is_not_held():
    # The heavy benchmark encoder on 2 cores: 688 rows/s alone, 747 in batches of 8 (within 9%). Eight
    # clients, one queued, seven on their way back at ~500 req/s: waiting for them cannot raise the rows
    # served per unit time by the 10% a bottleneck instance asks, busy loop or not.
    for busy in (None, 0.3, 0.95):
        w = AdaptiveWindow(500 * MS, 128)
        w.on_batch(1, int(1.453 * MS))
        w.on_batch(4, int(5.41 * MS))
        w.on_batch(8, int(10.71 * MS))
        now = 0
        for i in range(200):
            w.on_arrival(now, in_system=i % 8 + 1)
            now += 2 * MS
        w.on_frontend(busy)
        assert w.close_ns(now, 1, now, in_system=1) == now, busy

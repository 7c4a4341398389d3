"""What an arrival costs the batcher: the window is decided a few times per batch, and `submit` says when
an arrival needs the runner at all (the runner skips its turn, and keeps its timer, when it does not)."""

from __future__ import annotations

import numpy as np

from server.request import InferRequest
from server.scheduling.dynamic import BatchingSettings, DynamicBatcher
from server.scheduling.queue import QueuePolicy, RequestQueue

MS = 1_000_000
US = 1_000


def req() -> InferRequest:
    return InferRequest(model_name="m", inputs={"x": np.zeros((1, 4), np.float32)}, batch_size=1, batch_key=("x", (4,)))


def fixed(max_batch: int = 8, delay_ms: int = 5) -> DynamicBatcher:
    return DynamicBatcher(BatchingSettings(max_batch, max_queue_delay_ns=delay_ms * MS), RequestQueue([QueuePolicy()]))


def adaptive(clients: int, busy: float | None = None) -> tuple[DynamicBatcher, int]:
    """An adaptive batcher that has measured the model and seen `clients` closed-loop clients, and the time."""
    b = DynamicBatcher(BatchingSettings(128, latency_target_ns=50 * MS), RequestQueue([QueuePolicy()]))
    b.observe_frontend(busy)
    for size in (1, 8, 32, 128):
        b.window.on_batch(size, 60 * US + 26 * US * size)
    now = 0
    for _ in range(clients):  # everyone once, 0.3 ms apart: the apparent concurrency is `clients`
        now += 300 * US
        b.submit(req(), now)
    batch = b.next_batch(10**15)
    b.complete(batch, 60 * US + 26 * US * batch.size, now)
    return b, now


class Counting:
    """The batcher's real window, counting its decisions."""

    def __init__(self, window):
        self.window, self.decisions = window, 0

    def close_ns(self, *args):
        self.decisions += 1
        return self.window.close_ns(*args)

    def __getattr__(self, name):
        return getattr(self.window, name)


def test_an_arrival_into_a_decided_window_needs_no_turn_and_keeps_the_timer():
    b = fixed()
    assert b.submit(req(), 0) is True  # a new window: the runner must decide it and set the timer
    assert b.next_batch(0) is None
    timer = b.next_event_ns(0)
    assert timer == 5 * MS
    for i in range(1, 7):
        assert b.submit(req(), i * US) is False
        assert b.next_event_ns(i * US) == timer
    assert b.submit(req(), 7 * US) is True  # the eighth row fills the batch: cut it now
    assert len(b.next_batch(7 * US).requests) == 8


def test_an_arrival_after_the_window_closed_needs_a_turn():
    b = fixed()
    b.submit(req(), 0)
    b.next_batch(0)
    assert b.submit(req(), 5 * MS) is True
    assert len(b.next_batch(5 * MS).requests) == 2


def test_the_adaptive_window_is_decided_a_few_times_per_batch_not_per_arrival():
    b, now = adaptive(clients=32)
    counting = b.window = Counting(b.window)
    turns, batch = 0, None
    for _ in range(32):
        now += 300 * US
        if b.submit(req(), now):  # the runner's turn, only when the arrival matters
            turns += 1
            batch = b.next_batch(now)
            b.next_event_ns(now)
            if batch is not None:
                break
    assert batch is not None and batch.size >= 24  # cut once too few are still expected to grow it by a quarter
    assert counting.decisions <= 10 and turns <= 10  # decided at 1, 2, 3, 5, 8, 12, 18, 27 rows, not per arrival


def test_nobody_else_expected_ends_a_decided_window_at_once():
    b, now = adaptive(clients=8)
    counting = b.window = Counting(b.window)
    batch, close = None, None
    for _ in range(8):
        now += 300 * US
        if b.submit(req(), now):
            batch = b.next_batch(now)
            if batch is not None:
                break
            close = b.next_event_ns(now)
    assert batch is not None and close is not None and now < close  # before the close decided last
    assert counting.decisions < batch.size  # ended by the arrival's check, not by deciding again


def test_a_decision_leaves_with_its_head():
    b = fixed(delay_ms=5)
    first = req()
    b.submit(first, 0)
    b.next_batch(0)
    b.submit(req(), 2 * MS)
    assert b.next_event_ns(2 * MS) == 5 * MS
    assert b.cancel(first)
    assert b.next_event_ns(2 * MS) == 7 * MS  # the new head's window, not the cancelled one's

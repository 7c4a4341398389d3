"""The dynamic batcher and its queue as pure functions of time: no threads, no server."""

from __future__ import annotations

import numpy as np
import pytest

from server.errors import QueueFullError
from server.request import InferRequest
from server.scheduling.dynamic import BatchingSettings, DynamicBatcher
from server.scheduling.queue import DELAY, REJECT, QueuePolicy, RequestQueue

MS = 1_000_000


def req(rows: int = 1, key=("x", (4,)), priority: int = 0, timeout_us: int = 0, arrival_ns: int = 0) -> InferRequest:
    return InferRequest(model_name="m", inputs={"x": np.zeros((rows, 4), np.float32)}, batch_size=rows,
                        batch_key=key, priority=priority, timeout_us=timeout_us, arrival_ns=arrival_ns)


def batcher(max_batch=8, preferred=(), delay_ms=0, policies=None, default_level=1, join=True) -> DynamicBatcher:
    settings = BatchingSettings(max_batch, tuple(preferred), delay_ms * MS, join)
    return DynamicBatcher(settings, RequestQueue(policies or [QueuePolicy()], default_level))


def submit_all(b: DynamicBatcher, requests, now=0):
    for r in requests:
        b.submit(r, now)
    return requests


def test_waits_for_window_then_dispatches_everything_queued():
    b = batcher(max_batch=8, delay_ms=5)
    rs = submit_all(b, [req() for _ in range(3)])
    assert b.next_batch(1 * MS) is None
    assert b.next_event_ns(1 * MS) == 5 * MS
    batch = b.next_batch(5 * MS)
    assert batch.requests == rs and batch.size == 3 and len(b) == 0


def test_full_batch_leaves_at_once_and_rest_waits():
    b = batcher(max_batch=4, delay_ms=100)
    rs = submit_all(b, [req() for _ in range(6)])
    first = b.next_batch(0)
    assert first.requests == rs[:4]
    assert b.next_batch(0) is None and len(b) == 2


def test_rows_never_exceed_max_batch_size():
    b = batcher(max_batch=8, delay_ms=0)
    submit_all(b, [req(rows=3), req(rows=3), req(rows=3)])
    assert b.next_batch(0).size == 6
    assert b.next_batch(0).size == 3


def test_cut_at_largest_preferred_size_the_queue_fills():
    b = batcher(max_batch=16, preferred=(2, 4, 8), delay_ms=100)
    submit_all(b, [req() for _ in range(5)])
    assert b.next_batch(0).size == 4  # 5 queued: 4 is the largest preferred size reachable now
    assert b.next_batch(0) is None  # the 5th waits for company (or its window)
    assert b.next_batch(100 * MS).size == 1


def test_unjoinable_requests_form_separate_batches():
    b = batcher(max_batch=8, delay_ms=0)
    a1, c1, a2 = submit_all(b, [req(key=("x", (4,))), req(key=("x", (5,))), req(key=("x", (4,)))])
    assert b.next_batch(0).requests == [a1, a2]
    assert b.next_batch(0).requests == [c1]


def test_model_without_joining_runs_each_request_alone():
    b = batcher(max_batch=8, join=False)
    submit_all(b, [req(), req()])
    assert len(b.next_batch(0).requests) == 1 and len(b.next_batch(0).requests) == 1


def test_higher_priority_is_batched_first():
    b = batcher(max_batch=2, policies=[QueuePolicy()] * 3, default_level=3)
    low = submit_all(b, [req(), req()])  # priority 0 -> default level 3
    high = submit_all(b, [req(priority=1)])
    first = b.next_batch(0)
    assert first.requests == [high[0], low[0]]  # filled with the next most urgent of the same shape


def test_queue_limit_per_priority_level():
    b = batcher(policies=[QueuePolicy(max_queue_size=1), QueuePolicy(max_queue_size=2)], default_level=2)
    b.submit(req(priority=1), 0)
    with pytest.raises(QueueFullError, match="priority level 1 is full"):
        b.submit(req(priority=1), 0)
    b.submit(req(), 0)
    b.submit(req(), 0)
    with pytest.raises(QueueFullError):
        b.submit(req(), 0)
    assert len(b) == 3


def test_expired_request_is_rejected_on_time_and_never_batched():
    b = batcher(max_batch=8, delay_ms=50, policies=[QueuePolicy(REJECT)])
    late, ok = submit_all(b, [req(timeout_us=1000), req()])
    assert b.next_event_ns(0) == 1 * MS  # the deadline comes before the window
    assert b.expire(1 * MS) == [late]
    assert b.next_batch(50 * MS).requests == [ok]


def test_delay_action_moves_expired_request_behind_the_others():
    b = batcher(max_batch=1, delay_ms=0, policies=[QueuePolicy(DELAY)])
    late, other = submit_all(b, [req(timeout_us=1000), req()])
    assert b.expire(2 * MS) == []
    assert b.next_batch(2 * MS).requests == [other]
    assert b.next_batch(2 * MS).requests == [late]


def test_policy_default_timeout_and_override_rules():
    strict = QueuePolicy(default_timeout_us=5000, allow_timeout_override=False)
    assert strict.deadline_ns(0, 1000, None) == 5 * MS  # request may not override
    lenient = QueuePolicy(default_timeout_us=5000, allow_timeout_override=True)
    assert lenient.deadline_ns(0, 1000, None) == 1 * MS
    no_default = QueuePolicy()
    assert no_default.deadline_ns(0, 2000, None) == 2 * MS  # Ferry honours it; Triton would ignore it
    assert no_default.deadline_ns(0, 0, 3 * MS) == 3 * MS  # the gRPC deadline counts too
    assert no_default.deadline_ns(0, 0, None) is None


def test_cancelled_request_leaves_the_queue():
    b = batcher(max_batch=8, delay_ms=10)
    gone, stays = submit_all(b, [req(), req()])
    assert b.cancel(gone) and not b.cancel(gone)
    assert b.next_batch(10 * MS).requests == [stays]


def test_server_backstop_bounds_an_unbounded_policy():
    b = DynamicBatcher(BatchingSettings(8), RequestQueue([QueuePolicy(max_queue_size=0)], 1, max_total=2))
    b.submit(req(), 0)
    b.submit(req(), 0)
    with pytest.raises(QueueFullError, match="--max-queued-requests"):
        b.submit(req(), 0)
    b.next_batch(0)
    b.submit(req(), 0)  # room again once the queue drains


def test_deadline_heap_does_not_hold_requests_that_left():
    b = batcher(max_batch=1)
    keeper = req(timeout_us=10**9)  # a live head with a late deadline
    b.submit(keeper, 0)
    for _ in range(500):
        r = req(timeout_us=2 * 10**9)
        b.submit(r, 0)
        b.cancel(r)
    assert len(b.queue._deadlines) < 200  # dispatched or cancelled requests are shed, not kept alive
    assert b.expire(10**9 * 1000) == [keeper]


def test_group_row_count_follows_every_way_in_and_out():
    # the batcher trusts this count to skip walking the queue, so every path must keep it exact
    policy = QueuePolicy(timeout_action=DELAY, default_timeout_us=1000)
    b = batcher(max_batch=8, delay_ms=100, policies=[policy])
    rs = submit_all(b, [req(rows=2), req(rows=3), req(rows=1)])
    group = b.queue.groups()[0]

    def walked():
        return sum(r.batch_size for r in group)

    assert group.rows == walked() == 6
    b.cancel(rs[1])
    assert group.rows == walked() == 3
    b.expire(2 * MS)  # both DELAYed into the late lane of the same group
    assert group.rows == walked() == 3
    submit_all(b, [req(rows=4), req(rows=2)], now=2 * MS)  # 9 rows queued: over max_batch, a walk decides
    assert group.rows == walked() == 9
    assert b.next_batch(200 * MS).size == 8  # 4 + 2 from the live lane, then the late 2 (the late 1 won't fit)
    assert group.rows == walked() == 1

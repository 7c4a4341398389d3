"""The binpack policy as a pure function of time: cost buckets, budgets, learned boundaries, urgency."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from protos import model_config_pb2 as mc
from server.errors import ConfigError
from server.repository import config as config_io
from server.runners.factory import build_scheduler
from server.request import InferRequest
from server.scheduling.binpack import BinPackBatcher, BinPackSettings, CostBuckets, fit_boundaries
from server.scheduling.dynamic import BatchingSettings
from server.scheduling.queue import QueuePolicy, RequestQueue

MS = 1_000_000
KEY = (("x", (-1,)),)  # a variable-length input: every length shares one join key


def req(length: int, rows: int = 1, priority: int = 0, timeout_us: int = 0, cost: float = 0.0) -> InferRequest:
    return InferRequest(model_name="m", inputs={"x": np.zeros((rows, length), np.float32)}, batch_size=rows,
                        batch_key=KEY, priority=priority, timeout_us=timeout_us, length=length, cost=cost)


def binpack(max_batch=8, delay_ms=0, levels=1, **options) -> BinPackBatcher:
    settings = BatchingSettings(max_batch, max_queue_delay_ns=delay_ms * MS)
    return BinPackBatcher(settings, BinPackSettings(**options), RequestQueue([QueuePolicy()] * levels, levels))


def lengths(batch) -> list[int]:
    return [r.length for r in batch.requests]


def drain(b: BinPackBatcher, now: int = 0) -> list:
    batches = []
    while (batch := b.next_batch(now)) is not None:
        batches.append(batch)
    return batches


def test_requests_fall_into_buckets_by_cost():
    b = binpack(boundaries=(16, 128))
    assert [b.costs.bucket(b._cost(req(n))) for n in (1, 16, 17, 128, 129, 4000)] == [0, 0, 1, 1, 2, 2]
    quadratic = binpack(boundaries=(16, 128), quadratic=True)
    assert [quadratic.costs.bucket(quadratic._cost(req(n))) for n in (4, 5, 11, 12)] == [0, 1, 1, 2]
    assert b.costs.bucket(b._cost(req(4, cost=500))) == 2  # the request's `cost` parameter wins


def test_a_batch_never_mixes_buckets():
    b = binpack(boundaries=(16, 128))
    for n in (16, 512, 8, 100, 3, 700, 20, 1):
        b.submit(req(n), 0)
    batches = drain(b)
    assert sorted(map(lengths, batches)) == [[16, 8, 3, 1], [100, 20], [512, 700]]
    assert {batch.bucket for batch in batches} == {0, 1, 2}


def test_batch_cost_budget_counts_padding_and_rows():
    b = binpack(max_batch=16, delay_ms=100, max_batch_cost=100)
    for n in (10, 40, 10, 10):
        b.submit(req(n), 0)
    assert lengths(b.next_batch(0)) == [10, 40]  # a third row would pad to 3 x 40 = 120 > 100: full, leaves now
    assert b.next_batch(0) is None  # 2 x 10 leaves room for more: waits for its window
    assert lengths(b.next_batch(100 * MS)) == [10, 10]
    b.submit(req(30, rows=3), 0)
    b.submit(req(30), 0)
    assert b.next_batch(0).size == 3  # 3 rows x 30 = 90; one more row would be 120
    b.submit(req(250), 0)
    assert lengths(b.next_batch(100 * MS)) == [30]
    assert lengths(b.next_batch(0)) == [250]  # alone over budget: runs alone rather than never


def test_max_batch_size_still_bounds_rows():
    b = binpack(max_batch=4)
    for _ in range(6):
        b.submit(req(8), 0)
    assert [batch.size for batch in drain(b)] == [4, 2]


def test_fit_boundaries_minimises_padding():
    assert fit_boundaries([1, 1, 1, 10, 10, 100], 3) == (1, 10)
    assert fit_boundaries([1, 1, 1, 10, 10, 100], 2) == (10,)  # padding 9 x 3 beats 90 x 2
    assert fit_boundaries([7] * 50, 4) == ()  # nothing to separate
    assert fit_boundaries([], 4) == ()


def test_learned_boundaries_follow_a_shifted_distribution():
    rng = random.Random(0)
    buckets = CostBuckets((), count=2, window=256)
    for _ in range(256):
        buckets.observe(rng.randint(12, 20) if rng.random() < 0.9 else rng.randint(480, 512))
    assert buckets.boundaries == (20,)
    for _ in range(256):  # traffic shifts: everything four times longer
        buckets.observe(rng.randint(48, 80) if rng.random() < 0.9 else rng.randint(1920, 2048))
    assert 64 <= buckets.boundaries[0] <= 80 and len(buckets.boundaries) == 1  # the shorts' largest cost


def test_boundaries_are_learned_when_the_config_gives_none():
    b = binpack(num_buckets=2, learning_window=64)
    assert b.gauges().buckets == [(math.inf, 0)]  # nothing seen yet: one bucket
    for i in range(64):
        b.submit(req(512 if i % 10 == 0 else 16), 0)
    assert b.costs.boundaries == (16,)
    assert b.gauges().buckets[0][0] == 16 and b.gauges().buckets[1][0] == math.inf
    assert sum(depth for _, depth in b.gauges().buckets) == 64


def test_bucket_whose_head_is_due_first_runs_first():
    b = binpack(boundaries=(16,), stretch=4)
    measure(b, 8, exec_ms=5)  # a short request without deadline is due after 4 x 5 ms
    old_short = req(8)
    b.submit(old_short, 0)
    urgent_long = req(512, timeout_us=5_000)  # its deadline, 6 ms, comes first
    b.submit(urgent_long, 1 * MS)
    assert b.next_batch(2 * MS).requests == [urgent_long]
    assert b.next_batch(2 * MS).requests == [old_short]


def test_without_deadlines_the_oldest_head_wins_until_batch_times_are_known():
    b = binpack(boundaries=(16,))
    long, short = req(512), req(8)
    b.submit(long, 0)
    b.submit(short, 1)
    assert b.next_batch(2).requests == [long]


def test_higher_priority_level_wins_over_an_earlier_due_time():
    b = binpack(boundaries=(16,), levels=2)
    low = req(512, timeout_us=1_000)
    b.submit(low, 0)
    high = req(8, priority=1)
    b.submit(high, 0)
    assert b.next_batch(0).requests == [high]


def test_a_stream_of_short_requests_cannot_starve_a_long_one():
    b = binpack(boundaries=(16,), stretch=4)
    measure(b, 8, exec_ms=1)
    measure(b, 512, exec_ms=10)  # a long request is due after 40 ms
    long = req(512)
    b.submit(long, 0)
    served_before_long = 0
    for t in range(1, 100):  # one short request per ms, an instance free every ms
        b.submit(req(8), t * MS)
        batch = b.next_batch(t * MS)
        b.complete(batch, 1 * MS, t * MS)
        if long in batch.requests:
            break
        served_before_long += 1
    assert 30 <= served_before_long <= 40  # shorts overtake it only while it has slack


def measure(b: BinPackBatcher, length: int, exec_ms: float) -> None:
    """Run one batch of the bucket of `length` that took `exec_ms`, so the policy knows its batch time."""
    b.submit(req(length), 0)
    batch = b.next_batch(0)
    assert lengths(batch) == [length]
    b.complete(batch, int(exec_ms * MS), 0)


BINPACK_YAML = """
max_batch_size: 16
input: [{name: ids, data_type: TYPE_INT64, dims: [-1], variable_length: true}]
output: [{name: y, data_type: TYPE_FP32, dims: [4]}]
dynamic_batching:
  max_queue_delay_microseconds: 500
  priority_levels: 2
  default_priority_level: 2
  priority_queue_policy: {1: {max_queue_size: 3}}
binpack_batching: {cost_model: QUADRATIC, bucket_boundaries: [256, 4096], max_batch_cost: 65536}
"""


def test_binpack_scheduler_built_from_config_shares_the_queue_settings(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.yaml").write_text(BINPACK_YAML)
    config = config_io.read_config(tmp_path / "m")
    config_io.validate(config, "config.yaml")
    b = build_scheduler(config)
    assert isinstance(b, BinPackBatcher)
    assert b.binpack == BinPackSettings(quadratic=True, boundaries=(256, 4096), max_batch_cost=65536)
    assert b.settings.max_queue_delay_ns == 500_000 and b.settings.join
    assert b.queue.default_level == 2 and b.queue.policy(1).max_queue_size == 3


def test_bad_binpack_configs_are_refused():
    config = mc.ModelConfig(name="m", max_batch_size=8)
    config.binpack_batching.bucket_boundaries.extend([64, 16])
    with pytest.raises(ConfigError, match="strictly ascending"):
        build_scheduler(config)
    config = mc.ModelConfig(name="m", max_batch_size=0)
    config.binpack_batching.SetInParent()
    with pytest.raises(ConfigError, match="needs max_batch_size > 0"):
        build_scheduler(config)


def test_a_cheap_batch_takes_in_the_next_buckets_heads_up_to_min_batch_cost():
    submitted = (4, 4, 20, 30, 100, 500)
    plain, floored = binpack(boundaries=(16, 128)), binpack(boundaries=(16, 128), min_batch_cost=200)
    for b in (plain, floored):
        for n in submitted:
            b.submit(req(n), 0)
    assert list(map(lengths, drain(plain))) == [[4, 4], [20, 30, 100], [500]]
    batches = drain(floored)
    # 4 rows padded to 30 = 120 < 200; the 100 would make 5 x 100 = 500; a lone 100 cannot take the 500 either
    assert list(map(lengths, batches)) == [[4, 4, 20, 30], [100], [500]]
    assert [batch.bucket for batch in batches] == [0, 1, 2]
    assert len(floored) == 0
    assert floored._in_system == len(submitted)  # the window's count: dispatched and not completed yet
    for batch in batches:
        floored.complete(batch, None, 0)
    assert floored._in_system == 0


def test_min_batch_cost_keeps_max_batch_size_and_priority_levels():
    b = binpack(max_batch=3, levels=2, boundaries=(16,), min_batch_cost=1000)
    for n, priority in ((2, 1), (20, 2), (30, 1), (40, 1), (50, 1)):
        b.submit(req(n, priority=priority), 0)
    # the bucket above gives its level-1 requests first (the 20 waits at level 2); three rows at most
    assert list(map(lengths, drain(b))) == [[2, 30, 40], [50, 20]]


def test_min_batch_cost_is_read_from_the_config_and_checked():
    config = mc.ModelConfig(name="m", max_batch_size=8)
    config.binpack_batching.min_batch_cost = 256
    assert build_scheduler(config).binpack.min_batch_cost == 256
    config.binpack_batching.min_batch_cost = -1
    with pytest.raises(ConfigError, match="min_batch_cost"):
        build_scheduler(config)

"""A closed loop of clients behind one event loop, played against the real DynamicBatcher and its
adaptive window on a clock the test owns: which batches form, and how long the oldest request waits.

The event loop is modelled as one worker taking jobs in the order they became ready (a request to
decode and submit, an answer to encode, a finished batch to take back, a window's timer); the instance
runs a batch beside it. A light model on a saturated loop, roughly as the quiet benchmark run shows
it at 64 clients (1 / throughput fitted to 310 us per request + 600 us per batch): 310 us of loop time
per request, 600 us per dispatched batch, 60 us + 26 us per row on the instance. The busy share is
handed in as a number, as the runner hands in what server/observability/loop_load.py measured. What this model
cannot say is which policy serves most on a real machine (that is bench/dynamic_batching.py's job);
the tests here check what must hold whatever the costs.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from server.request import InferRequest
from server.scheduling.dynamic import BatchingSettings, DynamicBatcher
from server.scheduling.queue import QueuePolicy, RequestQueue

MS = 1_000_000
US = 1_000


@dataclass
class Played:
    batches: list[int] = field(default_factory=list)  # rows of each dispatched batch, in order
    oldest_waits_ns: list[int] = field(default_factory=list)  # the oldest request's queue wait, per batch
    cut_at_ns: list[int] = field(default_factory=list)  # when each batch was cut
    answered: int = 0


def play(clients: int, busy: float | None, duration_ns: int = 1_000 * MS, target_ms: int = 50) -> Played:
    settings = BatchingSettings(128, latency_target_ns=target_ms * MS)
    batcher = DynamicBatcher(settings, RequestQueue([QueuePolicy()]))
    batcher.observe_frontend(busy)
    cost = {"in": 155 * US, "out": 155 * US, "done": 0, "timer": 0}
    jobs: list = []  # (ready at, order, kind, payload): the loop's FIFO by readiness
    order = itertools.count()
    for _ in range(clients):
        heapq.heappush(jobs, (0, next(order), "in", None))
    played, loop_ns, instance_busy = Played(), 0, False
    while jobs and loop_ns < duration_ns:
        ready, _, kind, payload = heapq.heappop(jobs)
        loop_ns = max(loop_ns, ready) + cost[kind]
        if kind == "in":
            batcher.submit(InferRequest("m", {"x": np.zeros((1, 1), np.float32)}, 1, ()), loop_ns)
        elif kind == "out":
            played.answered += 1
            heapq.heappush(jobs, (loop_ns + 200 * US, next(order), "in", None))  # the client sends again
        elif kind == "done":
            batcher.complete(payload, 60 * US + 26 * US * payload.size, loop_ns)
            instance_busy = False
            for _ in payload.requests:
                heapq.heappush(jobs, (loop_ns, next(order), "out", None))
        if instance_busy:
            continue
        batch = batcher.next_batch(loop_ns)
        if batch is None:
            wake = batcher.next_event_ns(loop_ns)
            if wake is not None:
                heapq.heappush(jobs, (wake, next(order), "timer", None))
            continue
        played.batches.append(batch.size)
        played.oldest_waits_ns.append(loop_ns - batch.requests[0].enqueue_ns)
        played.cut_at_ns.append(loop_ns)
        loop_ns += 600 * US  # the dispatch: gather, executor hop, and later the wake-up that takes it back
        instance_busy = True
        heapq.heappush(jobs, (loop_ns + 60 * US + 26 * US * batch.size, next(order), "done", batch))
    return played


def test_a_saturated_loop_gets_larger_batches():
    for clients in (32, 64, 128):
        blind = play(clients, busy=None)  # no signal: batches grow only while the loop is busy elsewhere
        seeing = play(clients, busy=0.95)
        assert np.mean(seeing.batches) >= 1.1 * np.mean(blind.batches), clients


def test_the_loop_bound_window_holds_the_oldest_within_a_fifth_of_the_target():
    seeing = play(128, busy=0.95)
    # Past the start (all 128 clients at once: the first batch's end waits behind 127 decodes), the
    # oldest request has waited at most its share (10 ms of 50), plus the instance's run of the batch
    # before (at most 128 rows) and its dispatch, plus the loop job running when the window closed.
    steady = [w for w, at in zip(seeing.oldest_waits_ns, seeing.cut_at_ns) if at > 100 * MS]
    longest_run = 60 * US + 26 * US * 128 + 600 * US
    assert len(steady) > 20 and max(steady) <= 0.2 * 50 * MS + longest_run + 155 * US
    assert max(steady) > 0.1 * 50 * MS  # and the share is used: the loop keeps delivering rows


def test_a_lone_client_on_a_busy_loop_is_never_held():
    alone = play(1, busy=1.0)
    assert set(alone.batches) == {1} and max(alone.oldest_waits_ns) == 0
    few = play(3, busy=1.0)  # three clients: nobody else is coming, whatever the loop's load
    assert max(few.oldest_waits_ns) <= 60 * US + 26 * US * 3 + 600 * US + 155 * US  # only an instance's run

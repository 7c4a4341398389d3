"""A free instance of a model that does not batch waits for a longer train only while the event loop is
the bottleneck, more requests are coming and the instance has time to spare (server/scheduling/train_hold.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import numpy as np

from protos import model_config_pb2 as mc
from server.backends.base import Backend, Device
from server.observability.loop_load import LoopLoad
from server.observability.metrics import ModelStats
from server.request import InferRequest
from server.runners.batch import ModelRunner
from server.scheduling.dynamic import BatchingSettings, DynamicBatcher
from server.scheduling.queue import QueuePolicy, RequestQueue
from server.scheduling.train_hold import TrainHold
from server.tensors.signature import Signature
from server.worker import Worker
from tests.conftest import wait_for_async

MS = 1_000_000


def arrivals(hold: TrainHold, gap_ns: int, count: int = 30, in_server: float = 8) -> int:
    """`count` arrivals `gap_ns` apart, each answered after `in_server` gaps (Little's law: that many of
    the model's requests are in the server at once)."""
    now = 0
    for _ in range(count):
        hold.on_arrival(now)
        hold.on_answered([int(in_server * gap_ns)])
        now += gap_ns
    return now


def test_holds_while_the_loop_is_busy_and_requests_keep_coming():
    hold = TrainHold(3 * MS)
    now = arrivals(hold, MS // 2)
    assert hold.holds(now, 2, 8, 0.95, 50_000, None)
    assert hold.until_ns == now + 3 * MS  # bounded from when the instance began to wait
    assert hold.holds(now + MS, 3, 8, 0.95, 50_000, None)
    assert hold.until_ns == now + 3 * MS  # the same hold, not a new one


def test_the_hold_ends_when_the_train_is_full_or_its_time_is_up():
    hold = TrainHold(3 * MS)
    now = arrivals(hold, MS // 2)
    assert hold.holds(now, 2, 8, 0.95, 50_000, None)
    assert not hold.holds(now + MS, 8, 8, 0.95, 50_000, None)  # full
    assert hold.until_ns is None
    assert hold.holds(now + MS, 2, 8, 0.95, 50_000, None)  # a new hold, bounded anew
    assert not hold.holds(now + 4 * MS, 2, 8, 0.95, 50_000, None)  # its 3 ms are over
    # ... and not once what is left of it is shorter than the gap to the next arrival
    assert hold.holds(now + 5 * MS, 2, 8, 0.95, 50_000, None)
    assert not hold.holds(now + 8 * MS - MS // 4, 2, 8, 0.95, 50_000, None)


def test_no_hold_where_it_would_not_pay():
    quiet = TrainHold(3 * MS)
    now = arrivals(quiet, MS // 2)
    assert not quiet.holds(now, 2, 8, 0.5, 50_000, None)  # cores to spare: answer at once
    assert not quiet.holds(now, 2, 8, None, 50_000, None)  # loop load unknown
    assert not quiet.holds(now, 0, 8, 0.95, 50_000, None)  # nothing to hold
    assert not quiet.holds(now, 2, 8, 0.95, 300_000, None)  # executes fill over half the instance's time
    assert not quiet.holds(now, 2, 8, 0.95, 50_000, now + 2 * MS)  # a deadline inside the hold
    assert quiet.holds(now, 2, 8, 0.95, 50_000, now + 4 * MS)  # ... one after it does not stop it
    rare = TrainHold(3 * MS)
    assert not rare.holds(arrivals(rare, 5 * MS), 1, 8, 0.95, 50_000, None)  # nobody else is coming soon
    lone = TrainHold(3 * MS)
    assert not lone.holds(arrivals(lone, MS, in_server=0.8), 1, 8, 0.95, 50_000, None)  # its next comes once answered
    first = TrainHold(3 * MS)
    first.on_arrival(0)
    first.on_answered([8 * MS])
    assert not first.holds(0, 1, 8, 0.95, 50_000, None)  # one arrival: no rate known yet


class GatedTrains(Backend):
    """A backend that answers each request alone (as a Triton-face Python model does) and takes trains of
    up to 10, with a hold long enough that only a full train or the test ends it; its executes wait at a
    gate the test opens."""

    name, default_filename = "gated-trains", ""
    per_request = True
    HOLD_NS = 600 * 1000 * MS

    def __init__(self, config, model_path, device):
        super().__init__(config, model_path, device)
        self.started = threading.Semaphore(0)
        self.gate = threading.Event()

    def load(self) -> None:
        """The identity behind the gate: nothing to read."""

    def execute(self, inputs):
        raise AssertionError("a per-request backend is called through execute_requests")

    def can_send(self) -> bool:
        return False  # run on the instance's thread, where the gate can hold it

    def execute_requests(self, requests, inputs):
        self.started.release()
        assert self.gate.wait(60), "the test never opened the gate"
        return [{"y": i["x"]} for i in inputs]

    def train_limit(self) -> int:
        return 10

    def train_hold_ns(self) -> int:
        return self.HOLD_NS

    def execute_ns(self) -> int:
        return 1


def request(i: int, timeout_s: float | None = None) -> InferRequest:
    now = time.monotonic_ns()
    return InferRequest("m", {"x": np.full((1,), i, np.float32)}, 1, (("x", (1,)),), arrival_ns=now,
                        deadline_ns=None if timeout_s is None else now + int(timeout_s * 1e9))


def trains(busy: float, caplog, deadline_s: float | None = None, later: int = 3, hold_ns: int = 0) -> list[str]:
    """r0 runs held at the gate while r1-r7 queue; the gate opens and the instance frees; then r8-r10
    arrive (`later` of them). The sizes of the batches the runner cut, in order."""
    config = mc.ModelConfig(name="m", max_batch_size=0)
    config.input.add(name="x", data_type=mc.TYPE_FP32, dims=[1])
    config.output.add(name="y", data_type=mc.TYPE_FP32, dims=[1])
    backend = GatedTrains(config, None, Device("cpu"))
    if hold_ns:
        backend.HOLD_NS = hold_ns

    async def scenario():
        load = LoopLoad(asyncio.get_running_loop())
        load.close()
        load.busy_ratio = busy  # the measured share, pinned: the test holds the state, not the CPU
        worker = Worker(backend, Signature.from_config(config), "gated")
        scheduler = DynamicBatcher(BatchingSettings(0, join=False), RequestQueue([QueuePolicy()]))
        r = ModelRunner("m", 1, scheduler, [worker], ModelStats("m", 1, None), loop_load=load)
        # Many clients, whatever this machine's speed: their time in the server, pinned as the loop's load is
        # (only the latest answers move it, by a tenth each).
        r._hold.latency_ns = 10**15
        r.start()
        calls = [asyncio.create_task(r.infer(request(0)))]
        assert await asyncio.to_thread(backend.started.acquire, True, 30), "r0 never reached the backend"
        calls += [asyncio.create_task(r.infer(request(i, deadline_s))) for i in range(1, 8)]
        await wait_for_async(lambda: len(scheduler) == 7, 30, "r1-r7 queued")
        backend.gate.set()
        await calls[0]
        calls += [asyncio.create_task(r.infer(request(i, deadline_s))) for i in range(8, 8 + later)]
        results = await asyncio.gather(*calls)
        await r.close(grace_s=10)
        return results

    with caplog.at_level(logging.DEBUG, logger="server.runners.batch"):
        results = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [float(x["y"][0]) for x in results] == list(range(8 + later))
    return [m.split("batch of ")[1].split(" rows")[0] for m in caplog.messages if "batch of" in m]


def test_a_busy_loop_holds_the_free_instance_for_a_full_train(caplog):
    assert trains(0.95, caplog) == ["1", "10"]  # r1-r7 waited for r8-r10


def test_a_loop_with_time_to_spare_sends_what_is_queued_at_once(caplog):
    sizes = trains(0.5, caplog)
    assert sizes[:2] == ["1", "7"]  # r1-r7 left as soon as the instance was free
    assert sum(map(int, sizes)) == 11


def test_a_deadline_inside_the_hold_sends_at_once(caplog):
    sizes = trains(0.95, caplog, deadline_s=60)  # far off, but inside the 600 s hold
    assert sizes[:2] == ["1", "7"]


def test_a_hold_that_no_train_fills_ends_on_its_timer(caplog):
    """Nobody else comes: the runner's timer ends the hold and the seven leave together (a hold the
    timer did not end would keep them for ever, and the test would time out)."""
    assert trains(0.95, caplog, later=0, hold_ns=50 * MS) == ["1", "7"]

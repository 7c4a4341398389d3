"""Two runners sharing one resource through the rate limiter: after a batch of the better-priority
model, whose requests come back quickly, the resource waits for its next batch instead of going to the
flooded model waiting beside it (server/scheduling/rate_limiter.py, anticipation). The limiter's clock
and timers are the test's, so the hold lasts exactly as long as the test says."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from protos import model_config_pb2 as mc
from server.backends.base import Backend, Device
from server.observability.metrics import ModelStats
from server.request import InferRequest
from server.runners.batch import ModelRunner
from server.scheduling.dynamic import BatchingSettings, DynamicBatcher
from server.scheduling.queue import QueuePolicy, RequestQueue
from server.scheduling.rate_limiter import Need, RateLimiter
from server.tensors.signature import Signature
from server.worker import Worker
from tests.conftest import wait_for_async
from tests.unit.test_residency import Clock

MS = 1_000_000


class Counted(Backend):
    """The identity; counts its executes and holds each at a gate while the test says so."""

    name, default_filename = "counted", ""

    def __init__(self, config, model_path, device):
        super().__init__(config, model_path, device)
        self.executed = 0
        self.gate = threading.Event()
        self.gate.set()

    def load(self) -> None:
        """Nothing to read."""

    def execute(self, inputs):
        assert self.gate.wait(60), "the test never opened the gate"
        self.executed += 1
        return {"y": inputs["x"]}


def runner(name: str, priority: int, limiter: RateLimiter) -> tuple[ModelRunner, Counted, DynamicBatcher]:
    config = mc.ModelConfig(name=name, max_batch_size=0)
    config.input.add(name="x", data_type=mc.TYPE_FP32, dims=[1])
    config.output.add(name="y", data_type=mc.TYPE_FP32, dims=[1])
    backend = Counted(config, None, Device("cpu"))
    worker = Worker(backend, Signature.from_config(config), name)
    scheduler = DynamicBatcher(BatchingSettings(0, join=False), RequestQueue([QueuePolicy()]))
    need = Need(((("R", "cpu"), 1),), priority)
    limiter.register([need])
    return ModelRunner(name, 1, scheduler, [worker], ModelStats(name, 1, None), limits=(limiter, [need])), backend, scheduler


def request(name: str, i: int) -> InferRequest:
    return InferRequest(name, {"x": np.full((1,), i, np.float32)}, 1, (("x", (1,)),), arrival_ns=time.monotonic_ns())


def test_the_resource_waits_for_the_quiet_models_next_batch_then_goes_to_the_flood():
    clock = Clock()
    limiter = RateLimiter({("R", None): 1}, anticipate_ns=4 * MS, clock=lambda: clock.now, call_later=clock.call_later)

    async def scenario():
        quiet, quiet_model, _ = runner("quiet", 1, limiter)
        flood, flood_model, flood_queue = runner("flood", 2, limiter)
        quiet.start()
        flood.start()
        for i in range(4):  # the quiet model's client asks again 1 ms after each answer: learned
            await quiet.infer(request("quiet", i))
            clock.advance(MS)
        quiet_model.gate.clear()
        running = asyncio.create_task(quiet.infer(request("quiet", 4)))
        await wait_for_async(lambda: limiter.in_use("R") == 1, 30, "the quiet model's batch to hold the resource")
        waiting = asyncio.create_task(flood.infer(request("flood", 0)))
        await wait_for_async(lambda: len(flood_queue) == 1 and "flood" not in [w.backend.config.name for w in flood._held],
                             30, "the flood's request to wait for the resource")
        quiet_model.gate.set()
        await running
        await asyncio.sleep(0)  # a grant would have given the flood's runner its turn by now
        assert limiter.anticipated == 1 and flood_model.executed == 0 and len(flood_queue) == 1  # held for the quiet one
        clock.advance(MS)
        await quiet.infer(request("quiet", 5))  # it came back in time: it runs first
        assert limiter.anticipated_taken == 1 and flood_model.executed == 0
        clock.advance(10 * MS)  # this time the quiet one does not come back: the hold ends, the flood runs
        assert float((await waiting)["y"][0]) == 0 and flood_model.executed == 1
        await quiet.close(grace_s=10)
        await flood.close(grace_s=10)

    asyncio.run(asyncio.wait_for(scenario(), 60))

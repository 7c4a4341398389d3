"""A freed instance gets its next batch before the batch it finished is answered."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from protos import model_config_pb2 as mc
from server.backends.base import Backend, Device
from server.metrics import ModelStats
from server.request import InferRequest
from server.runner import ModelRunner
from server.scheduling.dynamic import BatchingSettings, DynamicBatcher
from server.scheduling.queue import QueuePolicy, RequestQueue
from server.signature import Signature
from server.worker import Worker


class Echo(Backend):
    """A real (if trivial) backend that takes long enough for a second request to queue behind it."""

    name, default_filename = "echo", ""

    def load(self) -> None:
        """Nothing to read: the model is the copy in execute."""

    def execute(self, inputs):
        time.sleep(0.05)
        return {"y": inputs["x"].copy()}


def test_next_batch_is_dispatched_before_the_finished_one_is_answered():
    config = mc.ModelConfig(name="m", max_batch_size=1)
    config.input.add(name="x", data_type=mc.TYPE_FP32, dims=[1])
    config.output.add(name="y", data_type=mc.TYPE_FP32, dims=[1])
    worker = Worker(Echo(config, None, Device("cpu")), Signature.from_config(config), "echo")
    scheduler = DynamicBatcher(BatchingSettings(1), RequestQueue([QueuePolicy()]))
    runner = ModelRunner("m", 1, scheduler, [worker], ModelStats("m", 1, None))

    def request(i: int) -> InferRequest:
        return InferRequest("m", {"x": np.full((1, 1), i, np.float32)}, 1, (("x", (1,)),), arrival_ns=time.monotonic_ns())

    async def scenario():
        runner.start()
        second = None

        async def first_caller():
            outputs = await runner.infer(request(0))
            # the first moment the first caller can see anything: the second must already be running
            return float(outputs["y"][0, 0]), len(runner.scheduler), len(runner._idle)

        first = asyncio.create_task(first_caller())
        await asyncio.sleep(0.01)  # the first request is running; the second queues behind it
        second = asyncio.create_task(runner.infer(request(1)))
        answer, queued, idle = await first
        await second
        await runner.close(grace_s=5)
        return answer, queued, idle, float(second.result()["y"][0, 0])

    answer, queued, idle, second_answer = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert (answer, second_answer) == (0.0, 1.0)
    assert queued == 0 and idle == 0  # taken from the queue and on the instance already

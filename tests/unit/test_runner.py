"""The model runner: it keeps its instances fed and answers every admitted request, however its loop ends."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from protos import model_config_pb2 as mc
from server.tensors.assembly import Assembler
from server.backends.base import Backend, Device
from server.errors import BackendError, ModelUnavailableError
from server.observability.metrics import ModelStats
from server.request import InferRequest
from server.runners.batch import ModelRunner
from server.scheduling.dynamic import BatchingSettings, DynamicBatcher
from server.scheduling.queue import QueuePolicy, RequestQueue
from server.tensors.signature import Signature
from server.worker import Worker
from tests.conftest import wait_for_async


class HeldEcho(Backend):
    """A real (if trivial) backend whose batches wait at a gate the test opens: "still running" is a
    state the test holds, not a guess about how long a batch takes."""

    name, default_filename = "held", ""
    executed = 0
    started = threading.Semaphore(0)  # released once per batch that reached the backend
    gate = threading.Event()

    @classmethod
    def reset(cls) -> None:
        cls.executed, cls.started, cls.gate = 0, threading.Semaphore(0), threading.Event()

    def load(self) -> None:
        """Nothing to read: the model is the identity behind the gate."""

    def execute(self, inputs):
        HeldEcho.executed += 1
        HeldEcho.started.release()
        assert HeldEcho.gate.wait(60), "the test never opened the gate"
        if (inputs["x"] < 0).any():
            raise ValueError("negative input")  # a request whose data this model cannot take
        return {"y": inputs["x"]}


async def running() -> None:
    """Wait until a batch is inside the backend (held at the gate)."""
    assert await asyncio.to_thread(HeldEcho.started.acquire, True, 30), "no batch reached the backend"


async def queued(r: ModelRunner, count: int) -> None:
    """Wait until `count` requests wait in the runner's scheduler."""
    await wait_for_async(lambda: len(r.scheduler) == count, 30, f"{count} requests queued")


def runner(max_batch_size: int = 1) -> ModelRunner:
    config = mc.ModelConfig(name="m", max_batch_size=max_batch_size)
    config.input.add(name="x", data_type=mc.TYPE_FP32, dims=[1])
    config.output.add(name="y", data_type=mc.TYPE_FP32, dims=[1])
    worker = Worker(HeldEcho(config, None, Device("cpu")), Signature.from_config(config), "held")
    scheduler = DynamicBatcher(BatchingSettings(max_batch_size), RequestQueue([QueuePolicy()]))
    return ModelRunner("m", 1, scheduler, [worker], ModelStats("m", 1, None))


def request(i: int, width: int = 1) -> InferRequest:
    return InferRequest("m", {"x": np.full((1, width), i, np.float32)}, 1, (("x", (1,)),), arrival_ns=time.monotonic_ns())


def test_requests_left_after_the_grace_period_are_answered_unavailable():
    HeldEcho.reset()

    async def scenario():
        r = runner()
        r.start()
        calls = [asyncio.create_task(r.infer(request(i))) for i in range(3)]
        await running()
        await queued(r, 2)
        closing = asyncio.create_task(r.close(grace_s=0.2))  # the first batch is held past the grace period
        await asyncio.wait(calls[1:])  # the queued two are answered once the grace runs out
        HeldEcho.gate.set()
        await closing
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert all(isinstance(x, ModelUnavailableError) for x in results[1:])
    assert all(isinstance(x, (dict, ModelUnavailableError)) for x in results)  # nobody is left waiting
    assert HeldEcho.executed == 1  # the batch that finished after the cut-off did not start another


def test_within_the_grace_period_everyone_is_served():
    HeldEcho.reset()

    async def scenario():
        r = runner()
        r.start()
        calls = [asyncio.create_task(r.infer(request(i))) for i in range(2)]
        await running()
        await queued(r, 1)
        closing = asyncio.create_task(r.close(grace_s=60))
        HeldEcho.gate.set()
        await closing
        return await asyncio.gather(*calls)

    results = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [float(x["y"][0, 0]) for x in results] == [0.0, 1.0]


def test_next_batch_is_dispatched_before_the_finished_one_is_answered():
    HeldEcho.reset()

    async def scenario():
        r = runner()
        r.start()

        async def first_caller():
            outputs = await r.infer(request(0))
            # the first moment the first caller sees anything: the second request must be running already
            return float(outputs["y"][0, 0]), len(r.scheduler), len(r._idle)

        first = asyncio.create_task(first_caller())
        await running()
        second = asyncio.create_task(r.infer(request(1)))
        await queued(r, 1)  # the second queues behind the first
        HeldEcho.gate.set()
        seen = await first
        second_answer = float((await second)["y"][0, 0])
        await r.close(grace_s=60)
        return (*seen, second_answer)

    answer, queued_left, idle, second_answer = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert (answer, second_answer) == (0.0, 1.0)
    assert queued_left == 0 and idle == 0  # taken from the queue and on the instance already


def test_a_batch_that_cannot_be_assembled_is_split_and_each_request_runs_alone():
    """Assembling happens on the event loop; a batch whose inputs cannot be joined is split like a
    failing one, and each request, alone, needs no joining."""
    HeldEcho.reset()

    async def scenario():
        r = runner(max_batch_size=2)
        r.start()
        first = asyncio.create_task(r.infer(request(0)))
        await running()
        # claims the same shape as request 1 but is not: the batch's inputs cannot be joined
        broken = [asyncio.create_task(r.infer(request(1))), asyncio.create_task(r.infer(request(2, width=3)))]
        await queued(r, 2)  # both wait behind the held batch, so they become one batch
        HeldEcho.gate.set()
        results = await asyncio.gather(first, *broken)
        after = await r.infer(request(3))
        await r.close(grace_s=60)
        return results, after, r.stats.batch_reruns

    (first, *split), after, reruns = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert float(first["y"][0, 0]) == 0.0
    assert [x["y"].tolist() for x in split] == [[[1.0]], [[2.0, 2.0, 2.0]]]
    assert float(after["y"][0, 0]) == 3.0
    assert reruns == 2 and HeldEcho.executed == 4  # the joined batch never reached the backend


def test_a_failing_request_fails_alone_and_its_batch_neighbours_are_answered():
    HeldEcho.reset()

    async def scenario():
        r = runner(max_batch_size=4)
        r.start()
        first = asyncio.create_task(r.infer(request(0)))
        await running()
        batch = [asyncio.create_task(r.infer(request(i))) for i in (1, 2, -3, 4)]
        await queued(r, 4)  # they become one batch of four behind the held one
        HeldEcho.gate.set()
        results = await asyncio.gather(first, *batch, return_exceptions=True)
        await r.close(grace_s=60)
        return results, r.stats

    (first, *batch), stats = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert float(first["y"][0, 0]) == 0.0
    assert [float(x["y"][0, 0]) for i, x in enumerate(batch) if i != 2] == [1.0, 2.0, 4.0]
    assert isinstance(batch[2], BackendError) and "negative input" in batch[2].message
    # 4 fails -> its halves (2 runs) -> the failing half's halves (2 runs): the bad one is alone
    assert stats.batch_reruns == 4 and HeldEcho.executed == 1 + 1 + 4
    assert stats.snapshot()["failures"] == {"BACKEND": 1}
    assert (stats.execution_count, stats.inference_count) == (1 + 2, 1 + 3)  # the parts that ran: [1, 2] and [4]


def test_batches_are_assembled_on_the_event_loop(monkeypatch):
    """The loop holds the GIL already; on the instance's thread the copy waited for it (worker.start)."""
    threads = []
    gather = Assembler.gather

    def recording(assembler, batch):
        threads.append(threading.get_ident())
        return gather(assembler, batch)

    monkeypatch.setattr(Assembler, "gather", recording)

    HeldEcho.reset()

    async def scenario():
        r = runner(max_batch_size=2)
        r.start()
        first = asyncio.create_task(r.infer(request(0)))
        await running()
        rest = [asyncio.create_task(r.infer(request(i))) for i in (1, 2)]
        await queued(r, 2)  # they become one batch of two behind the held one
        HeldEcho.gate.set()
        answers = await asyncio.gather(first, *rest)
        await r.close(grace_s=60)
        return answers

    answers = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [float(a["y"][0, 0]) for a in answers] == [0.0, 1.0, 2.0]
    assert len(threads) == 2 and set(threads) == {threading.get_ident()}  # asyncio.run's loop runs here


def test_the_loops_busy_share_reaches_the_adaptive_window():
    """The runner hands the measured front-end load to its scheduler at every cut (wiring, not timing:
    the value is whatever the loop measured, and the window must hold that very value)."""
    from server.observability.loop_load import LoopLoad

    HeldEcho.reset()
    HeldEcho.gate.set()

    async def scenario():
        load = LoopLoad(asyncio.get_running_loop(), interval_s=0.01)
        config = mc.ModelConfig(name="m", max_batch_size=4)
        config.input.add(name="x", data_type=mc.TYPE_FP32, dims=[1])
        config.output.add(name="y", data_type=mc.TYPE_FP32, dims=[1])
        worker = Worker(HeldEcho(config, None, Device("cpu")), Signature.from_config(config), "held")
        scheduler = DynamicBatcher(BatchingSettings(4, latency_target_ns=50_000_000), RequestQueue([QueuePolicy()]))
        r = ModelRunner("m", 1, scheduler, [worker], ModelStats("m", 1, None), loop_load=load)
        r.start()
        # A state, not a duration: LoopLoad measures on its own timer, between the loop's other callbacks.
        await wait_for_async(lambda: load.intervals >= 3, 60, "LoopLoad to measure three intervals")
        await r.infer(request(1))
        seen = scheduler.window.frontend_busy
        await r.close(grace_s=10)
        load.close()
        return load.intervals, seen

    intervals, seen = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert intervals >= 3
    assert seen is not None and 0.0 <= seen <= 1.0


def test_debug_log_shows_every_batch_as_it_was_cut(caplog):
    """`--log-level DEBUG` prints one line per dispatched batch (rows, requests, what was left queued, the
    window): what a tuning session reads to see the window's decisions. Batch sizes are held by the gate."""
    import logging

    HeldEcho.reset()

    async def scenario():
        r = runner(max_batch_size=4)
        r.start()
        first = asyncio.create_task(r.infer(request(0)))
        await running()
        rest = [asyncio.create_task(r.infer(request(i))) for i in range(1, 6)]  # 5 queue behind the held batch
        await queued(r, 5)
        HeldEcho.gate.set()
        await asyncio.gather(first, *rest)
        await r.close(grace_s=10)

    with caplog.at_level(logging.DEBUG, logger="server.runners.batch"):
        asyncio.run(asyncio.wait_for(scenario(), 60))
    lines = [m for m in caplog.messages if "batch of" in m]
    assert [line.split(" rows")[0].split("batch of ")[1] for line in lines] == ["1", "4", "1"]
    assert "(4 requests)" in lines[1] and "1 left queued" in lines[1] and "window 0.000 ms" in lines[1]

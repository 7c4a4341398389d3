"""Feeds one model version's instances from its scheduler, on the event loop.

The loop wakes on a new request, a finished batch, or the scheduler's next timer (a batching
window closing, a deadline passing), so deadlines fire on time even while every instance is busy.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from server.errors import DeadlineExceededError, FerryError, ModelUnavailableError
from server.metrics import ModelStats
from server.request import Batch, InferRequest
from server.scheduling.base import Scheduler
from server.worker import Worker

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, name: str, version: int, scheduler: Scheduler, workers: list[Worker], stats: ModelStats):
        self.name, self.version = name, version
        self.scheduler = scheduler
        self.workers = workers
        self.stats = stats
        self._idle = list(workers)
        self._running: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._accepting = True
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"runner-{self.name}-{self.version}")

    async def infer(self, request: InferRequest) -> dict[str, np.ndarray]:
        """Queue a request and wait for its outputs; a cancelled caller leaves the queue."""
        if not self._accepting:
            raise ModelUnavailableError(f"model '{self.name}' version {self.version} has stopped accepting requests")
        request.future = asyncio.get_running_loop().create_future()
        try:
            self.scheduler.submit(request, time.monotonic_ns())
        except FerryError:
            self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=False)
            raise
        self._wake.set()
        try:
            outputs = await request.future
        except asyncio.CancelledError:
            self.scheduler.cancel(request)
            self._wake.set()
            raise
        except FerryError:
            self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=False)
            raise
        self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=True)
        return outputs

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self._accepting or len(self.scheduler) or len(self._idle) < len(self.workers):
            now = time.monotonic_ns()
            for request in self.scheduler.expire(now):
                _fail(request, DeadlineExceededError(
                    f"request to model '{self.name}' waited {(now - request.enqueue_ns) / 1e6:.1f} ms in the queue "
                    "and its deadline passed before it could run"))
            # Draining: no one else is coming, so every batching window counts as closed.
            cut_at = now if self._accepting else now + 10**18
            while self._idle:
                batch = self.scheduler.next_batch(cut_at)
                if batch is None:
                    break
                self._dispatch(batch, now)
            self.stats.set_pending(len(self.scheduler))
            self._wake.clear()
            wake_ns = self.scheduler.next_event_ns(now)
            timer = None
            if wake_ns is not None:
                timer = loop.call_later(max(0, wake_ns - time.monotonic_ns()) / 1e9, self._wake.set)
            await self._wake.wait()
            if timer is not None:
                timer.cancel()

    def _dispatch(self, batch: Batch, now: int) -> None:
        worker = self._idle.pop()
        for request in batch.requests:
            self.stats.record_queued(now - request.enqueue_ns)
        task = asyncio.get_running_loop().create_task(self._run(worker, batch))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, worker: Worker, batch: Batch) -> None:
        started = time.monotonic_ns()
        try:
            result = await worker.run(batch)
        except FerryError as exc:
            log.warning("model '%s' batch of %d failed: %s", self.name, batch.size, exc.message)
            for request in batch.requests:
                _fail(request, exc)
        else:
            self.stats.record_batch(batch.size, len(batch.requests), result.input_ns, result.infer_ns, result.output_ns)
            self.scheduler.complete(batch, time.monotonic_ns() - started, time.monotonic_ns())
            for request, outputs in zip(batch.requests, result.outputs):
                if not request.future.done():
                    request.future.set_result(outputs)
        finally:
            self._idle.append(worker)
            self._wake.set()

    async def close(self, grace_s: float) -> None:
        """Stop admitting, let queued and running batches finish within the grace period, release workers."""
        self._accepting = False
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), grace_s)
            except TimeoutError:
                self._task.cancel()
        for worker in self.workers:
            await asyncio.to_thread(worker.close)


def _fail(request: InferRequest, error: FerryError) -> None:
    if not request.future.done():
        request.future.set_exception(error)

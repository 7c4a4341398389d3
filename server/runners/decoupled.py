"""The decoupled runner: a python model that answers each request with 0..N responses, as they come.

A decoupled model (`model_transaction_policy { decoupled: true }`) is Triton's way to stream from
user code: a `repeat` model, a tokenizer that emits pieces, a detector that reports as it goes.
Its `execute` is a generator: every dict it yields is one response, sent at once. Each request runs
alone on one instance's thread (the model decides how many responses a request gets, so there is
nothing to join); requests wait for a free instance in arrival order. A caller that goes away stops
its generator at the next response, and the instance is free again only once its thread is.

A client's `sequence_id`, `sequence_start` and `sequence_end` become the request's correlation id and
flags, as the model sees them (Triton's request.correlation_id() and flags()). With `sequence_batching
{ iterative_sequence: true }` each request is a sequence of its own, started with a correlation id
of its own; a request the model reschedules runs again on its instance at once (the backend's
`responses` sends it back), so its stream goes on until the model sends its final response.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import numpy as np

from server.backends.base import Backend
from server.errors import BackendError, FerryError, ModelUnavailableError
from server.observability.metrics import ModelStats, failure_reason
from server.observability.tracing.record import COMPUTE_END, COMPUTE_START, INFER_RESPONSE_COMPLETE, QUEUE_START
from server.request import InferRequest, with_parameters_of
from server.runners.base import DECOUPLED, RunnerBase
from server.runners.sequence_inputs import FLAG_END, FLAG_START
from server.scheduling.budget import ByteBudget
from server.tensors.signature import Signature

_DONE = object()


class DecoupledRunner(RunnerBase):
    serves = DECOUPLED

    def __init__(self, name: str, version: int, backends: list[Backend], signature: Signature, stats: ModelStats,
                 budget: ByteBudget | None = None, iterative: bool = False):
        super().__init__(name, version, stats, budget)
        self.iterative = iterative
        self._ids = itertools.count(1)  # correlation ids of iterative sequences the client did not name
        self.backends, self.signature = backends, signature
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"{name}-{version}-{i}") for i in range(len(backends))]
        self._idle: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(backends)):
            self._idle.put_nowait(i)
        self._streams = 0  # admitted, not yet finished
        self._stops: set[threading.Event] = set()  # one per running generator, set to stop it

    def _backends(self) -> list:
        return self.backends

    async def stream(self, request: InferRequest) -> AsyncIterator[dict[str, np.ndarray]]:
        """The request's responses as the model yields them; raises a FerryError if the model fails."""
        self._admit_check()
        self._sequence(request)
        self._take_bytes(request.nbytes, request.arrival_ns)
        self._streams += 1
        failure = ""
        trace = request.trace  # a sampled request's (tracing/record.py): each response is a timestamp
        if trace is not None:
            trace.mark(QUEUE_START)
        try:
            instance = await self._idle.get()
            self.stats.record_queued(time.monotonic_ns() - request.arrival_ns)
            if trace is not None:
                trace.mark(COMPUTE_START)
            async for outputs in self._run(instance, request):
                if trace is not None:
                    trace.mark(INFER_RESPONSE_COMPLETE)
                yield outputs
            if trace is not None:
                trace.mark(COMPUTE_END)
        except BaseException as exc:  # a caller that leaves closes the stream: GeneratorExit or CancelledError
            failure = "BACKEND" if isinstance(exc, FerryError) else failure_reason(exc)  # the model's own errors
            raise
        finally:
            self._give_bytes(request.nbytes)
            self._streams -= 1
            self._wake.set()
            self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=not failure, reason=failure)

    def _sequence(self, request: InferRequest) -> None:
        """The client's sequence parameters as the request's correlation id and flags (an iterative
        sequence starts here, under the client's id or one of its own)."""
        params = request.parameters
        cid = params.pop("sequence_id", 0)
        start, end = params.pop("sequence_start", False), params.pop("sequence_end", False)
        if self.iterative:
            request.correlation_id, request.sequence_flags = cid or next(self._ids), FLAG_START
        elif cid:
            request.correlation_id = cid
            request.sequence_flags = (FLAG_START if start else 0) | (FLAG_END if end else 0)

    async def _run(self, instance: int, request: InferRequest) -> AsyncIterator[dict[str, np.ndarray]]:
        loop = asyncio.get_running_loop()
        responses: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        self._stops.add(stop)

        def put(item) -> None:
            loop.call_soon_threadsafe(responses.put_nowait, item)

        started = time.monotonic_ns()
        running = loop.run_in_executor(self._threads[instance], self._produce, instance, request, put, stop)
        running.add_done_callback(lambda _: self._idle.put_nowait(instance))  # free once its thread is
        try:
            while (item := await responses.get()) is not _DONE:
                if isinstance(item, FerryError):
                    raise item
                yield item
        finally:
            self._stop(instance, stop)
            self._stops.discard(stop)
        self.stats.record_batch(request.batch_size, 1, 0, time.monotonic_ns() - started, 0)

    def _stop(self, instance: int, stop: threading.Event) -> None:
        """The stream is over for its caller: stop the generator, and tell the model (is_cancelled())."""
        if not stop.is_set():
            stop.set()
            cancel = getattr(self.backends[instance], "cancel", None)
            if cancel is not None:
                cancel()

    def _produce(self, instance: int, request: InferRequest, put, stop: threading.Event) -> None:
        """On the instance's thread: run the generator, hand each response to the loop."""
        try:
            for outputs in self.backends[instance].responses(request, stop):
                if stop.is_set():
                    return
                put(self._checked(outputs, not getattr(self.backends[instance], "per_request", False)))
        except FerryError as exc:
            put(exc)
        except Exception as exc:  # noqa: BLE001 - a model's failure fails its own request
            put(BackendError(f"model '{self.name}' failed: {type(exc).__name__}: {exc}"))
        finally:
            put(_DONE)

    def _checked(self, outputs: dict, strict_types: bool = True) -> dict[str, np.ndarray]:
        """Declared outputs only; with `strict_types` in their declared datatype (Triton's Python models
        answer in the dtype they made, as in Triton)."""
        checked = {}
        for name, value in outputs.items():
            spec = self.signature.outputs.get(name)
            if spec is None:
                raise BackendError(f"model '{self.name}' sent output '{name}', which its config does not declare")
            array = np.asarray(value)
            if strict_types and spec.datatype.api != "BYTES" and array.dtype != spec.datatype.numpy:
                raise BackendError(f"model '{self.name}' sent output '{name}' as {array.dtype}; "
                                   f"the config declares {spec.datatype.config}")
            checked[name] = array
        return with_parameters_of(checked, outputs)

    async def _loop(self) -> None:
        """Nothing to schedule: wait for the close, then for the streams still running."""
        while self._accepting or self._streams:
            self._wake.clear()
            await self._wake.wait()

    def _abandon_all(self, error: ModelUnavailableError) -> None:
        """Streams still running end when their generators do; their callers see the stream end."""

    async def _shutdown(self) -> None:
        for stop in list(self._stops):  # past the grace period: generators stop at their next response
            stop.set()
        for backend in self.backends:  # ... and a model that sends none is ended (its process killed)
            interrupt = getattr(backend, "interrupt", None)
            if interrupt is not None:
                interrupt()
        for thread, backend in zip(self._threads, self.backends):
            await asyncio.to_thread(thread.shutdown, True)
            await asyncio.to_thread(backend.unload)

"""The decoupled runner: a python model that answers each request with 0..N responses, as they come.

A decoupled model (`model_transaction_policy { decoupled: true }`) is Triton's way to stream from
user code: a `repeat` model, a tokenizer that emits pieces, a detector that reports as it goes. Its
`execute` sends responses through each request's response sender (Ferry's short face: a generator,
every dict it yields one response). Each request runs alone in an execute on one instance (the
model decides how many responses a request gets, so there is nothing to join); requests wait for a
free instance in arrival order. As in Triton, the instance is free again once `execute` returns:
responses a model sends afterwards (from a thread of its own) still reach their caller, while the
instance runs the next request. A caller that goes away makes the model's `is_cancelled()` true and
cancels the BLS calls its request made; what the model sends after that is dropped.

A client's `sequence_id`, `sequence_start` and `sequence_end` become the request's correlation id and
flags, as the model sees them (Triton's request.correlation_id() and flags()). With `sequence_batching
{ iterative_sequence: true }` each request is a sequence of its own, started with a correlation id
of its own; a request the model reschedules runs again on its instance at once (its execute does not
free the instance), so its stream goes on until the model sends its final response.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import numpy as np

from server.backends.base import STREAM_END, Backend
from server.errors import BackendError, FerryError, ModelUnavailableError
from server.observability.metrics import ModelStats, failure_reason
from server.observability.tracing.record import COMPUTE_END, COMPUTE_START, INFER_RESPONSE_COMPLETE, QUEUE_START
from server.request import InferRequest, with_parameters_of
from server.runners.base import DECOUPLED, RunnerBase
from server.runners.sequence_inputs import FLAG_END, FLAG_START
from server.scheduling.budget import ByteBudget
from server.tensors.signature import Signature


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
        self._open: set = set()  # the backends' handles of the streams running now

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
        """The request's responses; the instance goes back to the pool once its execute has returned."""
        loop = asyncio.get_running_loop()
        answers: asyncio.Queue = asyncio.Queue()
        backend = self.backends[instance]
        strict = not getattr(backend, "per_request", False)
        freed = False

        def free() -> None:
            nonlocal freed
            if not freed:
                freed = True
                self._idle.put_nowait(instance)

        started = time.monotonic_ns()
        opening = loop.run_in_executor(self._threads[instance], backend.open_stream, request,
                                       functools.partial(_on_loop, loop, answers.put_nowait),
                                       functools.partial(_on_loop, loop, free))
        try:
            stream = await asyncio.shield(opening)
        except asyncio.CancelledError:  # the caller left while the model's process started: end what opens
            opening.add_done_callback(functools.partial(_abandon, free))
            raise
        except BaseException:
            free()  # nothing was sent: no execute will return
            raise
        self._open.add(stream)
        backend.read_on_loop()
        try:
            while (item := await answers.get()) is not STREAM_END:
                if isinstance(item, FerryError):
                    raise item
                yield self._checked(item, strict)
        finally:
            stream.cancel()  # nothing more to read: whatever the model still sends is dropped
            self._open.discard(stream)
        self.stats.record_batch(request.batch_size, 1, 0, time.monotonic_ns() - started, 0)

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
        for stream in list(self._open):  # past the grace period: what the models still send is dropped
            stream.cancel()
        for backend in self.backends:  # ... and a model still running a request is ended (its process killed)
            interrupt = getattr(backend, "interrupt", None)
            if interrupt is not None:
                interrupt()
        for thread, backend in zip(self._threads, self.backends):
            await asyncio.to_thread(thread.shutdown, True)
            await asyncio.to_thread(backend.unload)


def _on_loop(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run `fn` on the loop: at once when called there, else handed over (a model process's reader thread)."""
    if asyncio._get_running_loop() is loop:
        fn(*args)
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


def _abandon(free, opening: asyncio.Future) -> None:
    """A stream whose caller left while it opened: cancelled once open (its execute frees the instance),
    or, if it could not open, its instance freed now."""
    if opening.cancelled() or opening.exception() is not None:
        free()
    else:
        opening.result().cancel()

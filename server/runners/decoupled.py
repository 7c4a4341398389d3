"""The decoupled runner: a python model that answers each request with 0..N responses, as they come.

A decoupled model (`model_transaction_policy { decoupled: true }`) is Triton's way to stream from
user code: a `repeat` model, a tokenizer that emits pieces, a detector that reports as it goes. Its
`execute` sends responses through each request's response sender (Ferry's short face: a generator,
every dict it yields one response). Requests wait for a free instance in arrival order. A model with
`dynamic_batching` and a `max_batch_size` gets the requests waiting then (up to max_batch_size rows,
those that can be joined with the oldest: the same shapes past dim 0) in one execute, as Triton's
dynamic batcher gives them, each with its own response sender; `max_queue_delay_microseconds` lets a
batch wait for more rows while an instance is free, and `default_queue_policy` bounds the requests
waiting (max_queue_size: more are refused UNAVAILABLE) and their time there (a request's `timeout`,
default_timeout_microseconds: DEADLINE_EXCEEDED when it passes before the request runs);
`priority_levels` put a higher-priority request ahead of those waiting at lower ones, each level with
its own queue policy. Otherwise each request runs alone in its execute. As in Triton, the instance
is free again once `execute` returns: responses a model sends afterwards (from a thread of its own)
still reach their caller, while the instance runs the next request. A caller that goes away makes the model's `is_cancelled()` true and
cancels the BLS calls its request made; what the model sends after that is dropped.

A client's `sequence_id`, `sequence_start` and `sequence_end` become the request's correlation id and
flags, as the model sees them (Triton's request.correlation_id() and flags()). A stateful model
(`sequence_batching`) requires them, gets the control inputs the config names, and runs each
sequence's requests in order on one instance, one per execute, as Triton's sequence batcher does. As
there, a sequence is live from its START to its END, a request of a sequence that is not live (never
started, ended, failed, or released after `max_sequence_idle_microseconds` without a request) is
refused, and an idle sequence is released, so a client that vanishes mid-sequence leaves nothing
behind (the model's own per-sequence state is the model's to drop, at its END or never).
With `sequence_batching { iterative_sequence: true }` each request is a sequence of its own, started
with a correlation id of its own; a request the model reschedules runs again on its instance at once (its execute does not
free the instance), so its stream goes on until the model sends its final response.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np

from server.backends.base import STREAM_END, Backend
from server.errors import (BackendError, DeadlineExceededError, FerryError, InvalidInputError, ModelUnavailableError,
                           QueueFullError, RequestCancelledError)
from server.observability.metrics import ModelStats, failure_reason
from server.observability.tracing.record import COMPUTE_END, COMPUTE_START, INFER_RESPONSE_COMPLETE, QUEUE_START
from server.request import InferRequest, with_parameters_of
from server.runners.base import DECOUPLED, RunnerBase
from server.runners.sequence_inputs import FLAG_END, FLAG_START, SequenceInputs, sequence_flags
from server.scheduling.budget import ByteBudget
from server.scheduling.queue import REJECT, QueuePolicy, RequestQueue
from server.scheduling.sequence_slots import SequenceSlots
from server.tensors.signature import Signature


@dataclass(frozen=True, slots=True)
class StreamBatching:
    """How many requests one execute of a decoupled model gets (Triton's dynamic batcher's settings)."""

    max_batch_size: int = 0  # rows per execute; 0: one request per execute
    max_queue_delay_ns: int = 0  # how long a batch that is not full may wait for more while an instance is free
    levels: RequestQueue | None = None  # dynamic_batching's priority levels and queue policies (None: one, the default)

    def level(self, priority: int) -> int:
        """A request's `priority` parameter as its level (0 or out of range: the default level, as Triton)."""
        return self.levels.level(priority) if self.levels is not None else 1

    def policy(self, level: int) -> QueuePolicy:
        return self.levels.policy(level) if self.levels is not None else _DEFAULT_POLICY

    @property
    def prioritized(self) -> bool:
        return self.levels is not None and len(self.levels.policies) > 1


_DEFAULT_POLICY = QueuePolicy()


@dataclass(slots=True, eq=False)
class _Waiting:
    """A request waiting for an instance: its caller awaits `opened` (the backend's stream handle)."""

    request: InferRequest
    answers: asyncio.Queue
    opened: asyncio.Future


class DecoupledRunner(RunnerBase):
    serves = DECOUPLED

    def __init__(self, name: str, version: int, backends: list[Backend], signature: Signature, stats: ModelStats,
                 budget: ByteBudget | None = None, iterative: bool = False, batching: StreamBatching = StreamBatching(),
                 sequence: SequenceInputs | None = None, slots: SequenceSlots | None = None):
        super().__init__(name, version, stats, budget)
        self.iterative = iterative
        self.batching = batching
        self.sequence = sequence  # a stateful model's control inputs (sequence_batching): requests need a sequence
        self.slots = slots  # a stateful model's live sequences (given with `sequence`; no limit on how many)
        self._bound: dict[object, int] = {}  # a live sequence's instance: its requests run there, one at a time
        self._pending: collections.Counter = collections.Counter()  # per live sequence: its requests not yet over
        self._ids = itertools.count(1)  # correlation ids of iterative sequences the client did not name
        self.backends, self.signature = backends, signature
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"{name}-{version}-{i}") for i in range(len(backends))]
        self._free: collections.deque[int] = collections.deque(range(len(backends)))
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None  # a batch's queue delay running out
        self._opening: set[asyncio.Task] = set()
        self._streams = 0  # admitted, not yet finished
        self._open: set = set()  # the backends' handles of the streams running now

    def _backends(self) -> list:
        return self.backends

    async def stream(self, request: InferRequest) -> AsyncIterator[dict[str, np.ndarray]]:
        """The request's responses as the model yields them; raises a FerryError if the model fails."""
        self._admit_check()
        live = self._sequence(request)
        self._take_bytes(request.nbytes, request.arrival_ns)
        self._streams += 1
        if live is not None:
            self._pending[request.correlation_id] += 1
        failure, ran = "", []
        trace = request.trace  # a sampled request's (tracing/record.py): each response is a timestamp
        if trace is not None:
            trace.mark(QUEUE_START)
        try:
            async for outputs in self._run(request, ran):
                if trace is not None:
                    trace.mark(INFER_RESPONSE_COMPLETE)
                yield outputs
            if trace is not None:
                trace.mark(COMPUTE_END)
        except BaseException as exc:  # a caller that leaves closes the stream: GeneratorExit or CancelledError
            # the model's own errors are BACKEND; a full queue REJECTED; a sequence that ended while the request
            # waited (it never ran) OTHER
            refused = isinstance(exc, (QueueFullError, DeadlineExceededError)) or (isinstance(exc, InvalidInputError)
                                                                                   and not ran)
            failure = "BACKEND" if isinstance(exc, FerryError) and not refused else failure_reason(exc)
            raise
        finally:
            # `cancel` holds the request's _Waiting, which holds the request: a cycle, freed only by the cycle
            # collector (rarely run, server/heap.py) with the request's tensors. Over now: nothing to cancel.
            request.cancel = None
            self._give_bytes(request.nbytes)
            self._streams -= 1
            if live is not None:
                self._sequence_request_over(request, live, reached_model=bool(ran))
            self._wake.set()
            self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=not failure, reason=failure)

    def _sequence(self, request: InferRequest):
        """The client's sequence parameters as the request's correlation id and flags (an iterative
        sequence starts here, under the client's id or one of its own); a stateful model's requests must
        name a live sequence (or start one), and get its control inputs (START, END, READY, CORRID) as
        Triton gives them. Returns the stateful model's live sequence the request belongs to."""
        params = request.parameters
        if self.sequence is not None:
            flags = sequence_flags(params, self.name)
            now = time.monotonic_ns()
            live = self.slots.begin(flags.cid, now) if flags.start else self.slots.touch(flags.cid, now)
            if live is None:
                raise _not_live(flags.cid, self.name)
            request.correlation_id = flags.cid
            request.sequence_flags = (FLAG_START if flags.start else 0) | (FLAG_END if flags.end else 0)
            request.inputs.update(self.sequence.tensors(flags.cid, flags.start, flags.end, None))
            return live
        cid = params.pop("sequence_id", 0)
        start, end = params.pop("sequence_start", False), params.pop("sequence_end", False)
        if self.iterative:
            request.correlation_id, request.sequence_flags = cid or next(self._ids), FLAG_START
        elif cid:
            request.correlation_id = cid
            request.sequence_flags = (FLAG_START if start else 0) | (FLAG_END if end else 0)

    def _sequence_request_over(self, request: InferRequest, live, reached_model: bool) -> None:
        """One of a live sequence's requests is over. One that never reached the model (refused or left in
        the queue) ends its sequence, as the model would otherwise see a sequence with a request missing
        (its START, say); one that ran leaves it live (the model answered it, errors included: the model
        decides what its sequence holds) and idle from now on if nothing more of it waits. Its END ended
        the sequence when it was taken to run."""
        cid = request.correlation_id
        self._pending[cid] -= 1
        if not self._pending[cid]:
            del self._pending[cid]
        if not reached_model:
            self._end_sequence(cid, live)
        else:
            self.slots.touch(cid, time.monotonic_ns())

    def _end_sequence(self, cid, live) -> None:
        """End `live` (not a sequence a START has since begun again under the same id)."""
        if self.slots.end(cid, live):
            self._bound.pop(cid, None)

    async def _run(self, request: InferRequest, ran: list) -> AsyncIterator[dict[str, np.ndarray]]:
        """The request's responses, once a free instance has taken it (in a batch where the model batches);
        `ran` gets an item once the model has it."""
        level = request.priority = self.batching.level(request.priority)
        policy = self.batching.policy(level)
        if policy.max_queue_size and sum(e.request.priority == level for e in self._waiting) >= policy.max_queue_size:
            raise QueueFullError(f"model '{self.name}': request queue for priority level {level} is full "
                                 f"(max_queue_size {policy.max_queue_size}); retry later or raise max_queue_size")
        loop = asyncio.get_running_loop()
        waiting = _Waiting(request, asyncio.Queue(), loop.create_future())
        self._waiting.append(waiting)
        deadline_ns = policy.deadline_ns(request.arrival_ns, request.timeout_us, request.deadline_ns)
        expiry = None
        if deadline_ns is not None and policy.timeout_action == REJECT:
            expiry = loop.call_later(max(deadline_ns - time.monotonic_ns(), 0) / 1e9, self._expire, waiting)
        self._dispatch()
        request.cancel = functools.partial(self._cancel_request, waiting)
        try:
            stream = await waiting.opened  # a caller that leaves cancels it: its batch drops it
        except asyncio.CancelledError:
            self._leave(waiting)
            raise
        finally:
            if expiry is not None:
                expiry.cancel()
        ran.append(True)
        strict = not getattr(stream.backend, "per_request", False)
        try:
            while (item := await waiting.answers.get()) is not STREAM_END:
                if isinstance(item, FerryError):
                    raise item
                yield self._checked(item, strict)
        finally:
            stream.cancel()  # nothing more to read: whatever the model still sends is dropped
            self._open.discard(stream)

    def _cancel_request(self, waiting: _Waiting) -> None:
        """Triton's request cancellation, its caller still reading: a queued request ends CANCELLED at once;
        a running one is told (is_cancelled()) and its stream goes on until the model ends it."""
        if not waiting.opened.done():
            self._leave(waiting)
            waiting.opened.set_exception(RequestCancelledError(f"model '{self.name}': the request was cancelled "
                                                               "before it ran"))
            return
        if waiting.opened.cancelled() or waiting.opened.exception() is not None:
            return
        stream = waiting.opened.result()
        tell = getattr(stream, "cancel_request", None)
        if tell is not None:
            tell()
        else:  # a backend that cannot tell a running request: its caller stops hearing from it, as if it left
            stream.cancel()
            waiting.answers.put_nowait(RequestCancelledError(f"model '{self.name}': the request was cancelled"))

    def _leave(self, waiting: _Waiting) -> None:
        if waiting in self._waiting:
            self._waiting.remove(waiting)
            self.stats.set_pending(len(self._waiting))

    def _expire(self, waiting: _Waiting) -> None:
        """A waiting request's deadline (its `timeout`, the queue policy's default, the call's) passed."""
        if waiting.opened.done() or waiting not in self._waiting:
            return
        self._leave(waiting)
        self.stats.record_deadline_miss()
        waited_ms = (time.monotonic_ns() - waiting.request.arrival_ns) / 1e6
        waiting.opened.set_exception(DeadlineExceededError(
            f"Request timeout expired: request to model '{self.name}' waited {waited_ms:.1f} ms in the queue and its "
            "deadline passed before it could run"))

    # ---- feeding the instances, on the event loop
    def _dispatch(self) -> None:
        """Give free instances the batches that are ready: after an arrival, a freed instance or a batch's
        queue delay running out."""
        started = True
        while started and self._free and self._waiting:
            started = False
            for instance in list(self._free):
                batch = self._next_batch(instance)
                if batch:
                    self._free.remove(instance)
                    self._start(instance, batch)
                    started = True
        self.stats.set_pending(len(self._waiting))

    def _next_batch(self, instance: int) -> list[_Waiting] | None:
        """For a free instance: the oldest waiting request it may run, with those that can join it (equal
        shapes past dim 0) up to max_batch_size rows; None while such a batch is not full and may still
        wait (max_queue_delay_microseconds), or when nothing waiting may run there. A stateful model's
        sequence runs on one instance, one request of it per execute, in order."""
        if self.sequence is not None:
            self._refuse_ended()
        waiting = self._waiting
        while waiting and waiting[0].opened.done():  # its caller left
            waiting.popleft()
        limit = self.batching.max_batch_size
        batch: list[_Waiting] = []
        rows, seen = 0, set()
        # the highest priority first (level 1), then arrival order
        for entry in sorted(waiting, key=_level) if self.batching.prioritized else waiting:
            request = entry.request
            if entry.opened.done() or not self._may_run(request, instance, seen):
                continue
            if batch and (request.batch_key != batch[0].request.batch_key or rows + request.batch_size > limit):
                continue
            batch.append(entry)
            rows += request.batch_size
            if limit <= 0 or rows >= limit:
                break
        if not batch:
            return None
        close_ns = batch[0].request.arrival_ns + self.batching.max_queue_delay_ns
        if 0 < rows < limit and time.monotonic_ns() < close_ns:
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_later((close_ns - time.monotonic_ns()) / 1e9, self._closed)
            return None
        chosen = set(map(id, batch))
        self._waiting = collections.deque(e for e in waiting if id(e) not in chosen)
        if self.sequence is not None:
            self._bind(batch, instance)
        return batch

    def _bind(self, batch: list[_Waiting], instance: int) -> None:
        """A stateful model's sequences stay on the instance that takes their requests until their END runs;
        what comes after an END must START again."""
        for entry in batch:
            cid = entry.request.correlation_id
            if entry.request.sequence_flags & FLAG_END:
                self._bound.pop(cid, None)
                self.slots.end(cid)
            else:
                self._bound[cid] = instance

    def _refuse_ended(self) -> None:
        """Waiting requests whose sequence ended while they waited (its END was taken to run, or a request of
        it never reached the model) are refused, as a late-comer would be, unless they start it again."""
        now, ended = time.monotonic_ns(), []
        for entry in self._waiting:
            request = entry.request
            if not (entry.opened.done() or request.sequence_flags & FLAG_START
                    or self.slots.touch(request.correlation_id, now)):
                entry.opened.set_exception(_not_live(request.correlation_id, self.name))
                ended.append(entry)
        for entry in ended:
            self._waiting.remove(entry)

    def _may_run(self, request: InferRequest, instance: int, seen: set) -> bool:
        """Whether the instance may take the request now (any, unless the model is stateful: then only the
        earliest waiting request of its sequence, and only on the instance its sequence runs on)."""
        if self.sequence is None:
            return True
        cid = request.correlation_id
        if cid in seen:  # a sequence's later request waits for the one before it
            return False
        seen.add(cid)
        return self._bound.get(cid, instance) == instance

    def _closed(self) -> None:
        self._timer = None
        self._dispatch()

    def _start(self, instance: int, batch: list[_Waiting]) -> None:
        """Open the batch's streams on the instance: here, when its model process is up and read by the
        loop; else on the instance's thread (the process may have to start first). The instance is free
        again once the execute has returned for every request."""
        loop = asyncio.get_running_loop()
        backend, now = self.backends[instance], time.monotonic_ns()
        for entry in batch:
            self.stats.record_queued(now - entry.request.arrival_ns)
            if entry.request.trace is not None:
                entry.request.trace.mark(COMPUTE_START)
        remaining = len(batch)
        # Counted now, so `executed` holds no _Waiting: each stream keeps `executed` and a _Waiting keeps its
        # stream (`opened`), a cycle that would keep the requests and their tensors until a collection.
        rows, requests = sum(e.request.batch_size for e in batch), len(batch)

        def executed() -> None:
            nonlocal remaining
            remaining -= 1
            if remaining == 0:
                self.stats.record_batch(rows, requests, 0, time.monotonic_ns() - now, 0)
                self._free.append(instance)
                self._dispatch()

        args = ([e.request for e in batch], [functools.partial(_on_loop, loop, e.answers.put_nowait) for e in batch],
                functools.partial(_on_loop, loop, executed))
        if not backend.opens_on_loop():
            task = asyncio.ensure_future(self._open_on_thread(instance, batch, args))
            self._opening.add(task)
            task.add_done_callback(self._opening.discard)
            return
        try:
            streams = backend.open_streams(*args)
        except Exception as exc:  # noqa: BLE001 - nothing was sent: no execute will return
            self._not_opened(instance, batch, exc)
            return
        self._opened(backend, batch, streams)

    async def _open_on_thread(self, instance: int, batch: list[_Waiting], args: tuple) -> None:
        backend = self.backends[instance]
        try:
            streams = await asyncio.get_running_loop().run_in_executor(self._threads[instance], backend.open_streams,
                                                                       *args)
        except BaseException as exc:
            self._not_opened(instance, batch, exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._opened(backend, batch, streams)

    def _opened(self, backend: Backend, batch: list[_Waiting], streams: list) -> None:
        for entry, stream in zip(batch, streams):
            if entry.opened.done():  # its caller left while the batch opened: what it sends is dropped
                stream.cancel()
            else:
                self._open.add(stream)
                entry.opened.set_result(stream)
        backend.read_on_loop()

    def _not_opened(self, instance: int, batch: list[_Waiting], exc: BaseException) -> None:
        """Nothing was sent: the batch's callers get the error (the model's process could not start)."""
        for entry in batch:
            if entry.opened.done():
                continue
            if isinstance(exc, asyncio.CancelledError):  # the server is stopping
                entry.opened.cancel()
            else:
                entry.opened.set_exception(exc)
        self._free.append(instance)
        self._dispatch()

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
        """Release idle sequences on time; wait for the close, then for the streams still running."""
        while self._accepting or self._streams:
            self._wake.clear()
            if self.slots is not None:
                for cid in self._release_idle(self.slots, set(self._pending)):
                    self._bound.pop(cid, None)
            await self._sleep(self.slots.next_event_ns() if self.slots is not None else None)

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


def _not_live(cid, model: str) -> InvalidInputError:
    return InvalidInputError(f"inference request for sequence {cid!r} to model '{model}' must specify the START flag "
                             "on the first request of the sequence (it is not active: never started, ended, failed "
                             "before it reached the model, or released after being idle)")


def _level(entry: _Waiting) -> int:
    return entry.request.priority


def _on_loop(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run `fn` on the loop: at once when called there, else handed over (a model process's reader thread)."""
    if asyncio._get_running_loop() is loop:
        fn(*args)
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass

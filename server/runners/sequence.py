"""The sequence runner: stateful models, whose requests belong to sequences (correlation ids).

A client marks a sequence's requests with `sequence_id` (uint64 or string), `sequence_start` and
`sequence_end`, as tritonclient does. The runner keeps each sequence's requests in order (a stream
may send them all at once), gives the model the control inputs (START, END, READY, CORRID) and the
implicit state carried from the sequence's previous request, and hands the request to an ordinary
batching runner, so requests of different sequences are batched together (at most one per sequence
in a batch, since a sequence's next request waits for its previous answer). Live sequences, their
slots and idle release are the pure policy in scheduling/sequence_slots.py.

An iterative sequence (`sequence_batching { iterative_sequence: true }`, Triton's request rescheduling)
is one request: it gets a correlation id of its own and a slot, and runs until the model answers it;
each time the model releases it to run again (RESCHEDULED) it goes back into the queue, batched with
whatever waits there, with the START flag only on its first run (the batching runner queues it again
itself, before the freed instance takes its next batch). A Python model thus generates step by step,
many requests' steps in one execute, with no sequence ids from the client.

A sequence that starts while every slot is taken waits in a backlog, first come first served, as
Triton's sequence batcher does: a freed slot (an END, a failure, an idle release) goes straight to
the oldest waiting sequence, so a newcomer can never overtake it. The wait is bounded by the
request's deadline and by the backlog's length (MAX_QUEUED_REQUESTS, then UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import time

import numpy as np

from server.defaults import MAX_QUEUED_REQUESTS
from server.errors import DeadlineExceededError, InvalidInputError, ModelUnavailableError, QueueFullError
from server.observability.metrics import failure_reason
from server.request import InferRequest
from server.runners.base import INFER, RunnerBase
from server.runners.batch import ModelRunner
from server.runners.sequence_inputs import (CORRID, FLAG_END, FLAG_START, SequenceFlags, SequenceInputs,
                                            sequence_flags)
from server.scheduling.sequence_slots import SequenceSlots

log = logging.getLogger(__name__)


class SequenceRunner(RunnerBase):
    serves = INFER

    def __init__(self, inner: ModelRunner, extra: SequenceInputs, slots: SequenceSlots, iterative: bool = False):
        super().__init__(inner.name, inner.version, inner.stats, inner.budget)
        self.inner, self.extra, self.slots, self.iterative = inner, extra, slots, iterative
        self._ids = itertools.count(1)  # correlation ids of iterative sequences the client did not name
        self._string_ids = any(c.kind == CORRID and c.dtype.api == "BYTES" for c in extra.controls)
        self._tails: dict[object, asyncio.Future] = {}  # per sequence: its last request's completion
        self._busy: dict[object, int] = {}  # sequences with a request in flight (never released idle)
        self._backlog: collections.deque[tuple[object, asyncio.Future]] = collections.deque()  # waiting STARTs

    def start(self) -> None:
        self.inner.start()
        super().start()

    async def infer(self, request: InferRequest) -> dict[str, np.ndarray]:
        self._admit_check()
        flags = self._own_sequence(request) if self.iterative else sequence_flags(request.parameters, self.name)
        self._check_corrid(flags)
        previous = self._tails.get(flags.cid)
        mine = self._tails[flags.cid] = asyncio.get_running_loop().create_future()
        self._busy[flags.cid] = self._busy.get(flags.cid, 0) + 1
        try:
            try:  # what happens here, before the inner runner has the request, is counted here
                if previous is not None:
                    await asyncio.shield(previous)  # the sequence's earlier request answers first
                live = await self._live(request, flags)
            except BaseException as exc:
                self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=False, reason=failure_reason(exc))
                raise
            return await self._run(request, flags, live)
        finally:
            mine.set_result(None)
            if self._tails.get(flags.cid) is mine:
                del self._tails[flags.cid]
            self._busy[flags.cid] -= 1
            if not self._busy[flags.cid]:
                del self._busy[flags.cid]
            self._wake.set()

    async def _live(self, request: InferRequest, flags: SequenceFlags):
        """The sequence's live slot for this request (waiting for one to free if it starts), or a refusal."""
        now = time.monotonic_ns()
        if flags.start:
            restart = self.slots.touch(flags.cid, now) is not None  # a live sequence restarting needs no new slot
            live = self.slots.begin(flags.cid, now) if restart or not self._backlog else None  # no overtaking
            if live is None:
                live = await self._wait_for_slot(flags.cid, request.deadline_ns)
        else:
            live = self.slots.touch(flags.cid, now)
        if live is None:
            raise InvalidInputError(f"inference request for sequence {flags.cid!r} to model '{self.name}' must "
                                    "specify the START flag on the first request of the sequence (it is not active: "
                                    "never started, ended, or released after being idle)")
        if request.batch_size != 1:
            raise InvalidInputError(f"model '{self.name}' serves sequences: each request carries one row, got {request.batch_size}")
        return live

    async def _run(self, request: InferRequest, flags: SequenceFlags, live) -> dict[str, np.ndarray]:
        """The inner runner runs the step (and counts its outcome); the sequence's state carries on. An
        iterative sequence's request may run many times (rerun readies each run after the first)."""
        self._ready(request, flags, flags.start, live)
        if self.iterative:
            request.rerun = functools.partial(self._ready, request, flags, False, live)
        try:
            outputs = await self.inner.infer(request)
        except BaseException:
            self._end(flags.cid)  # a failed step leaves no state to carry on from
            raise
        live.state = self.extra.carried(outputs)
        self.slots.touch(flags.cid, time.monotonic_ns())
        if flags.end or self.iterative:
            self._end(flags.cid)
        return self.extra.visible(outputs)

    def _ready(self, request: InferRequest, flags: SequenceFlags, start: bool, live) -> None:
        """The request's control inputs, implicit state, correlation id and flags for its next run."""
        request.inputs = {**request.inputs, **self.extra.tensors(flags.cid, start, flags.end, live.state)}
        request.correlation_id, request.sequence_flags = flags.cid, (FLAG_START if start else 0) | (FLAG_END if flags.end else 0)

    def _own_sequence(self, request: InferRequest) -> SequenceFlags:
        """An iterative sequence is its request: it starts now, with the client's correlation id if it
        gave one, else one of its own (an id no live sequence holds)."""
        params = request.parameters
        if params.get("sequence_id") not in (None, 0, ""):
            return SequenceFlags(sequence_flags(params, self.name).cid, True, False)
        params.pop("sequence_start", None)
        params.pop("sequence_end", None)
        cid = None
        while cid is None or cid in self._tails:
            cid = str(next(self._ids)) if self._string_ids else next(self._ids)
        return SequenceFlags(cid, True, False)

    async def _wait_for_slot(self, cid, deadline_ns: int | None):
        """Wait in the backlog until a freed slot is handed to `cid`; refuse past the deadline or limit."""
        if len(self._backlog) >= MAX_QUEUED_REQUESTS:
            raise QueueFullError(f"model '{self.name}': all {self.slots.capacity} sequence slots are in use and "
                                 f"{len(self._backlog)} sequences wait for one; retry later")
        granted = asyncio.get_running_loop().create_future()
        self._backlog.append((cid, granted))
        log.info("model '%s': sequence %r waits for a sequence slot (%d waiting)", self.name, cid, len(self._backlog))
        timeout = None if deadline_ns is None else max(0.0, (deadline_ns - time.monotonic_ns()) / 1e9)
        try:
            return await asyncio.wait_for(asyncio.shield(granted), timeout)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                self._end(cid)  # granted as we gave up: pass the slot on
            else:
                granted.cancel()  # _grant skips it
            if isinstance(exc, TimeoutError):
                raise DeadlineExceededError(f"sequence {cid!r} of model '{self.name}' waited for a sequence slot "
                                            "until its deadline passed") from None
            raise

    def _end(self, cid) -> None:
        self.slots.end(cid)
        self._grant()

    def _grant(self) -> None:
        """Hand free slots to the oldest waiting sequences (a slot is taken for them before they wake)."""
        while self._backlog:
            cid, granted = self._backlog[0]
            if granted.done():
                self._backlog.popleft()
                continue
            live = self.slots.begin(cid, time.monotonic_ns())
            if live is None:
                return
            self._backlog.popleft()
            granted.set_result(live)

    def _check_corrid(self, flags: SequenceFlags) -> None:
        for c in self.extra.controls:
            if c.kind == CORRID and (c.dtype.api == "BYTES") != isinstance(flags.cid, str):
                kind = "a string" if c.dtype.api == "BYTES" else "an integer"
                raise InvalidInputError(f"model '{self.name}' takes {kind} correlation id ('sequence_id'), "
                                        f"got {flags.cid!r}")

    async def _loop(self) -> None:
        """Release idle sequences on time; end when closed and the inner runner has drained."""
        while self._accepting:
            self._release_idle(self.slots, set(self._busy))
            self._grant()
            self._wake.clear()
            await self._sleep(self.slots.next_event_ns())

    async def close(self, grace_s: float) -> None:
        self._accepting = False
        self._wake.set()
        while self._backlog:  # never started: nothing of theirs to drain
            _, granted = self._backlog.popleft()
            if not granted.done():
                granted.set_exception(ModelUnavailableError(
                    f"model '{self.name}' stopped before a sequence slot was free for this sequence"))
        await self.inner.close(grace_s)
        if self._task is not None:
            await self._task

    def _abandon_all(self, error: ModelUnavailableError) -> None:
        """Admitted requests wait on the inner runner, which answers them however it stops."""

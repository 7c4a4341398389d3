"""The batching runner: feeds one model version's instances from its scheduler, on the event loop.

The runner takes a turn (feed free instances from the scheduler, keep one timer set for the scheduler's next
event) when something happens: a request arrives while an instance is free and the scheduler says the
arrival matters (it may complete a batch or move the next event; one that only joins a window already
decided does not), or with a deadline sooner than the timer; the timer fires (a batching window closing, a
deadline passing); an instance is freed. So deadlines fire on time even while every instance is busy, and
neither a busy model nor a waiting window pays a turn per arrival. An arrival's or the timer's turn runs
once the callbacks ready at that moment have run (requests arriving in one pass of the event loop are
offered together, as when a wake-up of the loop's task ran it), but as one plain callback: on a light model
at 64 clients, waking the loop's task per arrival (a task switch, a timer cancelled and made again) was a
good part of what the runner cost per request. The loop's task runs the first turn and the drain.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable

import numpy as np

from server import response_cache
from server.errors import BackendError, DeadlineExceededError, FerryError, ModelUnavailableError, QueueFullError
from server.observability.loop_load import LoopLoad
from server.observability.metrics import ModelStats
from server.request import RESCHEDULED, Batch, InferRequest
from server.response_cache import ResponseCache
from server.runners.base import INFER, RunnerBase
from server.runners.isolation import Outcome, run_isolated
from server.runners.ordering import ResponseOrder
from server.scheduling.base import Scheduler
from server.scheduling.budget import ByteBudget
from server.scheduling.rate_limiter import Need, RateLimiter
from server.scheduling.train_hold import TrainHold
from server.observability.tracing.batches import batch_ran
from server.observability.tracing.record import QUEUE_START
from server.worker import BatchResult, Worker

log = logging.getLogger(__name__)
_FAR_FUTURE_NS = 10**18
# A gRPC caller's deadline clock starts when it sends, ours when the call arrives, so a caller gives up
# (and its cancellation reaches us) up to a transit time before the deadline we hold, often before the
# queue's timer fires (uvloop's timers have millisecond grain). A queued call cancelled this close to its
# deadline was cancelled by it, and counts as a deadline miss, as the timer would have counted it.
_CALLER_CLOCK_LEAD_NS = 10_000_000


class ModelRunner(RunnerBase):
    serves = INFER

    def __init__(self, name: str, version: int, scheduler: Scheduler, workers: list[Worker], stats: ModelStats,
                 preserve_ordering: bool = False, budget: ByteBudget | None = None, loop_load: LoopLoad | None = None,
                 cache: ResponseCache | None = None, limits: tuple[RateLimiter, list[Need]] | None = None):
        super().__init__(name, version, stats, budget)
        # --rate-limit execution_count: each instance runs only while its group's resources are free
        self._limiter, needs = limits if limits is not None and any(n.counts for n in limits[1]) else (None, [])
        self._needs = dict(zip(workers, needs))
        self._held: set[Worker] = set()  # instances holding their resources (about to run, or running)
        self._granted: list[Worker] = []  # idle instances the limiter reserved resources for while they waited
        self.scheduler = scheduler
        self._cache = cache  # the server's response cache, when this model's config enables it
        self._cache_scope = f"{name}\0{version}\0{self.load_id}"
        self._loop_load = loop_load  # the front end's busy share, handed to the scheduler at every cut
        self.workers = workers
        self._order = ResponseOrder() if preserve_ordering else None
        self._idle = list(workers)
        self._running: set[asyncio.Task] = set()
        self._admitted: set[InferRequest] = set()  # queued or running, not yet answered
        self._timer: asyncio.TimerHandle | None = None  # set for the scheduler's next event
        self._timer_ns: int | None = None  # when that timer fires (None: no timer set)
        self._turn_due = False  # a turn is scheduled (call_soon) and has not run yet
        self._cut_off = False  # the drain grace ran out: dispatch nothing more
        hold_ns = max(w.backend.train_hold_ns() for w in workers) if workers else 0
        self._hold = TrainHold(hold_ns) if hold_ns else None  # free instances waiting for longer trains

    def _backends(self) -> list:
        return [w.backend for w in self.workers]

    def _abandon_all(self, error: ModelUnavailableError) -> None:
        for request in list(self._admitted):
            _abandon(request, error)

    def infer(self, request: InferRequest) -> Awaitable[dict[str, np.ndarray]]:
        """Queue a request and wait for its outputs (await it); a cancelled caller leaves the queue. Not a
        coroutine itself: the caller awaits the one doing the work, one coroutine per request, not two."""
        self._admit_check()
        if self._cache is not None:  # a hit never queues (server/response_cache.py)
            return response_cache.answer(self._cache, self._cache_scope, request, self.stats, self._queue_and_wait)
        return self._queue_and_wait(request)

    async def _queue_and_wait(self, request: InferRequest) -> dict[str, np.ndarray]:
        """Charge the request's bytes to the budgets, queue it, wait for its outputs; the bytes are given
        back however it ends."""
        self._take_bytes(request.nbytes, request.arrival_ns)
        request.future = asyncio.get_running_loop().create_future()
        if request.trace is not None:
            request.trace.mark(QUEUE_START)
        now = time.monotonic_ns()
        try:
            matters = self.scheduler.submit(request, now)
        except BaseException as exc:
            self._give_bytes(request.nbytes)
            if isinstance(exc, QueueFullError):
                self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=False, reason="REJECTED")
            raise
        if self._order is not None:
            self._order.admit(request)
        holding = False
        if self._hold is not None:
            self._hold.on_arrival(now)
            holding = self._hold.waits_for(len(self.scheduler), request.deadline_ns)
        self._admitted.add(request)
        if not holding and ((self._idle and matters is not False) or _sooner(request.deadline_ns, self._timer_ns)):
            self._turn_soon()
        else:  # nothing to cut now and the timer set is still right: the timer or the next release cuts the batch
            self.stats.set_pending(len(self.scheduler))
        try:
            outputs = await request.future
        except asyncio.CancelledError:
            if self._order is None and _answered(request.future):
                raise  # answered (and counted with its batch) just before the caller left
            self._caller_left(request)
            raise
        except FerryError as exc:
            reason = "BACKEND" if not isinstance(exc, DeadlineExceededError) else "REJECTED"
            self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=False, reason=reason)
            raise
        finally:
            self._admitted.discard(request)
            self._give_bytes(request.nbytes)
        if self._order is not None:  # otherwise counted with its batch, when answered (_answer)
            self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=True)
        return outputs

    def _caller_left(self, request: InferRequest) -> None:
        """The caller of an unanswered request went away (cancelled, or its deadline passed): out of the queue
        if it is still there; if it runs in a model process, that process is told (its BLS calls are cancelled)."""
        now = time.monotonic_ns()
        queued = self.scheduler.cancel(request)
        missed = queued and request.expired(now + _CALLER_CLOCK_LEAD_NS)
        if queued:
            self._wake.set()
        elif request.caller_left is not None:
            request.caller_left()
        if missed:
            self.stats.record_deadline_miss()
        self._finish(request, lambda: None)  # never blocks later answers behind a vanished caller
        self.stats.record_done(now - request.arrival_ns, ok=False, reason="REJECTED" if missed else "CANCELED")

    async def _loop(self) -> None:
        """Runs the turns nothing else runs (start, drain) and ends once drained; arrivals, the timer
        and freed instances have theirs run without it (_turn_soon, _release)."""
        try:
            while self._accepting or len(self.scheduler) or len(self._idle) < len(self.workers):
                self._turn(time.monotonic_ns())
                self._wake.clear()
                await self._wake.wait()
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._timer_ns = None

    def _turn(self, now: int) -> None:
        """One turn of the runner: feed free instances, publish the gauges, keep the timer set for the
        scheduler's next event (the one already set stays when it is still right)."""
        self._feed(now)
        self.stats.set_gauges(self.scheduler.gauges())
        wake_ns = self.scheduler.next_event_ns(now)
        if self._hold is not None and self._hold.until_ns is not None and (wake_ns is None or self._hold.until_ns < wake_ns):
            wake_ns = self._hold.until_ns
        if wake_ns != self._timer_ns:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = None if wake_ns is None else asyncio.get_running_loop().call_later(
                max(0, wake_ns - time.monotonic_ns()) / 1e9, self._timer_fired)
            self._timer_ns = wake_ns

    def _turn_soon(self) -> None:
        """A turn once the callbacks ready now have run, as a wake-up of the loop's task would run it (so
        requests arriving in one pass of the event loop are offered together), without waking a task."""
        if not self._turn_due:
            self._turn_due = True
            asyncio.get_running_loop().call_soon(self._due_turn)

    def _due_turn(self) -> None:
        self._turn_due = False
        if self._task is None or self._task.done() or self._cut_off:
            return  # stopping: a batch started now would only delay the shutdown
        try:
            self._turn(time.monotonic_ns())
        except Exception:  # the loop runs the turn instead (and fails loudly if it must)
            log.exception("model '%s': a turn of the runner failed; waking its loop", self.name)
            self._wake.set()

    def _timer_fired(self) -> None:
        self._timer = self._timer_ns = None  # fired: set no more, even if it fired a hair early
        self._turn_soon()

    def _feed(self, now: int) -> None:
        """Expire what is overdue, then give every idle instance a batch the scheduler is ready to cut."""
        self._expire(now)
        if self._loop_load is not None:
            self.scheduler.observe_frontend(self._loop_load.busy_ratio)
        # Draining: nobody else is coming, so every batching window counts as closed.
        cut_at = now if self._accepting else _FAR_FUTURE_NS
        while self._idle:
            worker = self._idle[-1] if self._limiter is None else self._free_worker()
            if worker is None:
                break  # every idle instance waits for its resources; the limiter's grant brings a turn
            limit = worker.train_limit()
            if limit > 1 and self._hold is not None and self._waits_for_train(worker, limit, now):
                self._unhold(worker)
                break
            batch = self.scheduler.next_batch(cut_at)
            if batch is None:
                self._unhold(worker)
                break
            if not batch.batched and limit > 1:
                batch = self._train(batch, limit, cut_at)
            self._dispatch(batch, now, worker)

    def _waits_for_train(self, worker: Worker, limit: int, now: int) -> bool:
        """Whether the free instance waits a moment for a longer train (server/scheduling/train_hold.py);
        never while draining."""
        busy = self._loop_load.busy_ratio if self._loop_load is not None and self._accepting else None
        return self._hold.holds(now, len(self.scheduler), limit, busy, worker.backend.execute_ns(),
                                self.scheduler.next_event_ns(now))

    def _train(self, first: Batch, limit: int, cut_at: int) -> Batch:
        """More of the requests waiting now, in the scheduler's order, behind a model that does not batch:
        the backend runs each alone, and the whole train costs one hop (Backend.train_limit)."""
        requests = list(first.requests)
        while len(requests) < limit and (batch := self.scheduler.next_batch(cut_at)) is not None:
            requests += batch.requests
        return Batch(requests, False) if len(requests) > 1 else first

    def _free_worker(self) -> Worker | None:
        """An idle instance whose resources it holds now (reserved while it waited, or free), else None after
        putting the idle instances in the limiter's line when requests wait."""
        while self._granted:
            worker = self._granted.pop()
            if worker in self._held and worker in self._idle:
                return worker
        for worker in reversed(self._idle):
            need = self._needs.get(worker)
            if need is None or not need.counts:
                return worker
            if self._limiter.try_acquire(need):
                self._held.add(worker)
                return worker
        if len(self.scheduler):
            for worker in self._idle:
                self._limiter.wait(worker, self._needs[worker], functools.partial(self._reserved, worker))
        return None

    def _reserved(self, worker: Worker) -> None:
        """The limiter reserved `worker`'s resources for it: a turn uses them (or gives them back)."""
        self._held.add(worker)
        self._granted.append(worker)
        self._turn_soon()

    def _unhold(self, worker: Worker) -> None:
        if worker in self._held:
            self._held.discard(worker)
            self._limiter.release(self._needs[worker])

    def _expire(self, now: int) -> None:
        for request in self.scheduler.expire(now):
            self.stats.record_deadline_miss()
            waited_ms = (now - request.enqueue_ns) / 1e6
            self._fail(request, DeadlineExceededError(
                f"Request timeout expired: request to model '{self.name}' waited {waited_ms:.1f} ms in the queue and its deadline "
                "passed before it could run"))

    def _dispatch(self, batch: Batch, now: int, worker: Worker) -> None:
        self._idle.remove(worker)
        if log.isEnabledFor(logging.DEBUG):  # `--log-level DEBUG`: one line per batch, to see what the window did
            self._trace(batch, now)
        self.stats.record_dispatched(batch.requests, now)  # queue times; DELAY requests past their deadline run late
        worker.start(batch, functools.partial(self._ran, worker, batch))

    def _ran(self, worker: Worker, batch: Batch, running: asyncio.Future[BatchResult]) -> None:
        """A batch's first run is over. Answered here, in the future's callback, when it succeeded (no
        task per batch); a failure is isolated by a task (_run)."""
        if running.cancelled() or running.exception() is not None:
            task = asyncio.get_running_loop().create_task(self._run(worker, batch, running))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            return
        outcome = Outcome([(batch, running.result())])
        try:
            self._requeue(outcome)
            self._give_back(worker, batch, outcome)
        finally:
            self._answer(batch, outcome, worker)

    def _trace(self, batch: Batch, now: int) -> None:
        gauges = self.scheduler.gauges()
        busy = self._loop_load.busy_ratio if self._loop_load is not None else None
        log.debug("model '%s': batch of %d rows (%d requests), oldest waited %.3f ms, %d left queued, window %.3f ms, "
                  "loop busy %s", self.name, batch.size, len(batch.requests), (now - batch.requests[0].enqueue_ns) / 1e6,
                  gauges.pending, gauges.window_ns / 1e6, "unknown" if busy is None else f"{busy:.2f}")

    async def _run(self, worker: Worker, batch: Batch, running: asyncio.Future[BatchResult]) -> None:
        """Answer a batch whose first run failed: it is split until its failing requests run alone
        (runners/isolation.py), on this instance, before the instance takes another batch."""
        parts = iter([running])

        def run(part: Batch) -> asyncio.Future[BatchResult]:
            return next(parts, None) or worker.start(part)  # the first run is the one already dispatched

        outcome = None
        try:
            outcome = await run_isolated(run, batch, self._unexpected)
            self._requeue(outcome)
        finally:
            self._give_back(worker, batch, outcome)
        self._answer(batch, outcome, worker)

    def _give_back(self, worker: Worker, batch: Batch, outcome: Outcome | None) -> None:
        """The batch's instance time to the scheduler, then the instance to the pool."""
        done = time.monotonic_ns()
        try:
            self.scheduler.complete(batch, _instance_ns(outcome), done)
        except Exception:  # the instance and the answers must not be lost with it
            log.exception("model '%s': the scheduler failed to take back a batch", self.name)
        self._release(worker, done)

    def _requeue(self, outcome: Outcome) -> None:
        """Requests the model rescheduled (iterative sequences) go back into the queue before the freed
        instance takes its next batch, so each run joins whatever waits there, as continuous batching
        does; their callers wait on until the model answers them."""
        for part, result in outcome.answered:
            for request, outputs in zip(part.requests, result.outputs):
                if outputs is not RESCHEDULED or request.rerun is None or request.future.done():
                    continue
                request.rerun()
                try:
                    self.scheduler.submit(request, time.monotonic_ns())
                except FerryError as exc:  # a full queue: the request ends here, with the reason
                    self._fail(request, exc)

    def _answer(self, batch: Batch, outcome: Outcome, worker: Worker) -> None:
        if outcome.reruns:
            self.stats.record_reruns(outcome.reruns)
            log.warning("model '%s': a batch of %d requests failed; %d re-runs isolated %d failing request(s): %s",
                        self.name, len(batch.requests), outcome.reruns, len(outcome.failed),
                        outcome.failed[0][1].message if outcome.failed else "none failed alone")
        for part, result in outcome.answered:
            self.stats.record_batch(part.size, len(part.requests), result.input_ns, result.infer_ns, result.output_ns,
                                    result.padding.padded, result.padding.computed, part.bucket, part.executions)
            traced = [request for request in part.requests if request.trace is not None]
            if traced:
                batch_ran(traced, self.name, part.size, len(part.requests), result.padding.padded, worker.name, result)
            if self._order is None:  # nothing to keep in order: set each answer now, no closure per request
                now, totals = time.monotonic_ns(), []
                for request, outputs in zip(part.requests, result.outputs):
                    if isinstance(outputs, FerryError):  # a backend that answers requests alone failed this one
                        self._fail(request, outputs)
                    elif outputs is RESCHEDULED:
                        self._rescheduled(request)
                    elif not request.future.done():
                        request.future.set_result(outputs)
                        totals.append(now - request.arrival_ns)
                self.stats.record_successes(totals)  # one lock for the batch, not one per request
                if self._hold is not None:
                    self._hold.on_answered(totals)
            else:
                self._answer_in_order(part, result)
        for request, error in outcome.failed:
            if not outcome.reruns:
                log.warning("model '%s' request failed: %s", self.name, error.message)
            self._fail(request, error)

    def _answer_in_order(self, part: Batch, result) -> None:
        for request, outputs in zip(part.requests, result.outputs):
            if outputs is RESCHEDULED:
                self._rescheduled(request)
            else:
                self._finish(request, _setter(request, error=outputs) if isinstance(outputs, FerryError)
                             else _setter(request, outputs))

    def _rescheduled(self, request: InferRequest) -> None:
        """Queued again by _requeue; only a model outside an iterative sequence cannot be run again (the
        model process refuses that itself: this is the guard behind it)."""
        if request.rerun is None and not request.future.done():
            self._fail(request, BackendError(f"model '{self.name}' rescheduled a request, but only an iterative "
                                             "sequence model (sequence_batching.iterative_sequence) runs one again"))

    def _unexpected(self, exc: Exception) -> BackendError:
        """A failure that is not one of Ferry's domain errors (e.g. inputs that cannot be joined)."""
        log.error("model '%s': unexpected error running a batch", self.name, exc_info=exc)
        return BackendError(f"model '{self.name}': {type(exc).__name__}: {exc}")

    def _release(self, worker: Worker, now: int) -> None:
        """Refill a freed instance at once, before its batch is answered: answering wakes one handler per
        request, and the instance would otherwise sit idle while the loop encodes and sends them all.
        The price: those answers wait for the next batch's inputs to be copied (~0.5 ms for 1.5 MB)."""
        if self._limiter is not None:
            self._unhold(worker)  # instances of other models waiting for these resources are served first
        self._idle.append(worker)
        if not self._accepting:
            self._wake.set()  # draining: the loop ends once every instance is back
        current = asyncio.current_task()
        if self._task is None or self._task.done() or self._cut_off or (current is not None and current.cancelling()):
            self._wake.set()
            return  # stopping: a batch started now would only delay the shutdown
        try:
            self._turn(now)
        except Exception:  # the loop feeds again on its wake (and fails loudly if it must)
            log.exception("model '%s': refilling a freed instance failed", self.name)
            self._wake.set()

    def _fail(self, request: InferRequest, error: FerryError) -> None:
        self._finish(request, _setter(request, error=error))

    def _finish(self, request: InferRequest, settle) -> None:
        if self._order is None:
            settle()
        else:
            self._order.finish(request, settle)

    async def _shutdown(self) -> None:
        self._cut_off = True  # set before anything else runs: the loop may only be cancelling yet
        if self._limiter is not None:
            for worker in self.workers:
                self._limiter.forget(worker)
                self._unhold(worker)
        for worker in self.workers:
            await asyncio.to_thread(worker.close)


def _instance_ns(outcome) -> int | None:
    """What the batch cost its instance: assembly plus the run on its thread. Not the wall time until the
    loop took the answer back: on a busy loop that adds the loop's own lag, which would make a light
    model look compute bound (and the adaptive window then stops waiting just when waiting pays).
    None when it failed or was split: no clean measurement."""
    if outcome is None or outcome.failed or outcome.reruns:
        return None
    result = outcome.answered[0][1]
    return result.input_ns + result.infer_ns + result.output_ns


def _answered(future: asyncio.Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _sooner(deadline_ns: int | None, timer_ns: int | None) -> bool:
    return deadline_ns is not None and (timer_ns is None or deadline_ns < timer_ns)


def _abandon(request: InferRequest, error: FerryError) -> None:
    if request.future is not None and not request.future.done():
        request.future.set_exception(error)


def _setter(request: InferRequest, outputs=None, error: FerryError | None = None):
    def settle() -> None:
        if request.future.done():
            return
        if error is not None:
            request.future.set_exception(error)
        else:
            request.future.set_result(outputs)

    return settle

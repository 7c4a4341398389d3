"""Drives one generation model: scheduler plan -> model step in a thread -> tokens streamed to callers.

The event loop owns the scheduler; the step thread only runs the model. While a step runs, new
requests queue and cancelled ones are marked; both take effect at the next step, so a request joins
the running batch within one step of arriving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator

from server.backends.llm.engine import LLMBackend
from server.backends.llm.tokenizer import IncrementalDetokenizer, StopStrings
from server.errors import BackendError, DeadlineExceededError, FerryError, ModelUnavailableError
from server.generation_metrics import GenerationStats
from server.metrics import ModelStats
from server.runner import drain
from server.scheduling.continuous import ContinuousScheduler
from server.scheduling.sequence import SamplingParams, Sequence

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GenerationEvent:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    error: FerryError | None = None


@dataclass(slots=True)
class _Stream:
    """Per-request state the runner keeps beside the scheduler's Sequence."""

    events: asyncio.Queue
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    scheduled_ns: int | None = None
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    done: bool = field(default=False)


class GenerationRunner:
    def __init__(self, name: str, version: int, backend: LLMBackend, scheduler: ContinuousScheduler,
                 stats: ModelStats, gen_stats: GenerationStats):
        self.name, self.version = name, version
        self.backend = backend
        self.scheduler = scheduler
        self.stats = stats
        self.gen_stats = gen_stats
        self._ids = itertools.count()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-{version}-llm")
        self._wake = asyncio.Event()
        self._accepting = True
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"generate-{self.name}-{self.version}")
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """However the loop ended (drained, cut off after the grace period, crashed), answer everyone left."""
        self._accepting = False
        if not task.cancelled() and task.exception() is not None:
            log.error("model '%s': generation loop failed", self.name, exc_info=task.exception())
        for seq in self.scheduler.running + self.scheduler.waiting():
            if not seq.handle.done:
                self._fail(seq, ModelUnavailableError(f"model '{self.name}' stopped before this request finished"))

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, priority: int,
                       deadline_ns: int | None, arrival_ns: int) -> AsyncIterator[GenerationEvent]:
        """Stream events for one request; leaving the iteration early (client gone) cancels it."""
        if not self._accepting:
            raise ModelUnavailableError(f"model '{self.name}' has stopped accepting requests")
        seq = Sequence(next(self._ids), list(prompt_ids), len(prompt_ids), sampling, priority=priority or 1,
                       arrival_ns=arrival_ns, deadline_ns=deadline_ns)
        stream = _Stream(asyncio.Queue(), IncrementalDetokenizer(self.backend.tokenizer, prompt_ids), StopStrings(sampling.stop))
        seq.handle = stream
        try:
            self.scheduler.submit(seq)
        except FerryError:
            self.stats.record_done(time.monotonic_ns() - arrival_ns, ok=False, reason="REJECTED")
            raise
        self._wake.set()
        try:
            while True:
                event = await stream.events.get()
                if event.error is not None:
                    raise event.error
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not stream.done:
                seq.cancelled = True
                self._wake.set()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self._accepting or self.scheduler.running or self.scheduler.num_waiting:
            now = time.monotonic_ns()
            self._retire(now)
            plan = self.scheduler.schedule()
            self._publish()
            if not plan:
                await self._idle(now)
                continue
            for seq, _ in plan.entries:
                if seq.handle.scheduled_ns is None:
                    seq.handle.scheduled_ns = now
                    self.stats.record_queued(now - seq.arrival_ns)
                    self.gen_stats.observe("queue_us", now - seq.arrival_ns)
            try:
                sampled = await loop.run_in_executor(self._thread, self.backend.step, plan)
            except Exception as exc:  # noqa: BLE001 - a failed step fails the sequences in it, not the server
                log.exception("model '%s': step failed", self.name)
                for seq, _ in plan.entries:
                    self.scheduler.finish(seq, "error")
                    self._fail(seq, BackendError(f"model '{self.name}' failed: {type(exc).__name__}: {exc}"))
                continue
            done = time.monotonic_ns()
            self.scheduler.postprocess(plan, sampled)
            self.stats.record_batch(len(sampled), len(plan.entries), 0, done - now, 0)
            for seq, _ in plan.entries:
                token = sampled.get(seq.seq_id)
                if token is not None and not seq.cancelled:
                    self._emit(seq, token, done)

    def _retire(self, now: int) -> None:
        """Drop cancelled sequences, expire waiting ones, stop running ones past their deadline."""
        for seq in self.scheduler.drop_cancelled():
            seq.handle.done = True
            self.stats.record_done(now - seq.arrival_ns, ok=False, reason="CANCELED")
        for seq in self.scheduler.expire(now):
            waited = (now - seq.arrival_ns) / 1e6
            self._fail(seq, DeadlineExceededError(
                f"generation request to model '{self.name}' waited {waited:.1f} ms and its deadline passed before it ran"))
        for seq in [s for s in self.scheduler.running if s.deadline_ns is not None and now >= s.deadline_ns]:
            self.scheduler.finish(seq, "deadline")
            self._final(seq, "deadline", "", [], now)

    async def _idle(self, now: int) -> None:
        self._wake.clear()
        deadlines = [s.deadline_ns for s in self.scheduler.waiting() if s.deadline_ns is not None]
        timer = None
        if deadlines:
            timer = asyncio.get_running_loop().call_later(max(0, min(deadlines) - now) / 1e9, self._wake.set)
        await self._wake.wait()
        if timer is not None:
            timer.cancel()

    def _emit(self, seq: Sequence, token: int, now: int) -> None:
        stream, params = seq.handle, seq.sampling
        if stream.first_token_ns is None:
            stream.first_token_ns = now
            self.gen_stats.observe("ttft_us", now - seq.arrival_ns)
        else:
            self.gen_stats.observe("itl_us", now - stream.last_token_ns)
        stream.last_token_ns = now
        finish, stopped = None, False
        if token in self.backend.eos_token_ids and not params.ignore_eos:
            finish, text = "eos", ""
        else:
            text, stopped = stream.stops.feed(stream.detokenizer.add(token))
            if stopped or token in params.stop_token_ids:
                finish = "stop"
        if finish is None and (seq.num_output >= params.max_tokens or seq.num_tokens >= self.backend.max_model_len):
            finish = "length"
        if finish is None:
            stream.events.put_nowait(GenerationEvent([token], text))
            return
        if not stopped:  # release held text: an unfinished character, a possible stop-string start
            tail, stopped = stream.stops.feed(stream.detokenizer.flush())
            text += tail + ("" if stopped else stream.stops.flush())
        self.scheduler.finish(seq, finish)
        self._final(seq, finish, text, [token], now)

    def _final(self, seq: Sequence, reason: str, text: str, tokens: list[int], now: int) -> None:
        stream = seq.handle
        stream.done = True
        first = stream.first_token_ns or now
        self.stats.record_done(now - seq.arrival_ns, ok=True)
        self.gen_stats.observe("e2e_us", now - seq.arrival_ns)
        stream.events.put_nowait(GenerationEvent(
            tokens, text, reason, prompt_tokens=seq.prompt_len, completion_tokens=seq.num_output,
            queue_ms=((stream.scheduled_ns or now) - seq.arrival_ns) / 1e6, ttft_ms=(first - seq.arrival_ns) / 1e6,
            total_ms=(now - seq.arrival_ns) / 1e6))

    def _fail(self, seq: Sequence, error: FerryError) -> None:
        seq.handle.done = True
        self.stats.record_done(time.monotonic_ns() - seq.arrival_ns, ok=False,
                               reason="REJECTED" if isinstance(error, DeadlineExceededError) else "BACKEND")
        seq.handle.events.put_nowait(GenerationEvent([], "", error=error))

    def _publish(self) -> None:
        s, pool = self.scheduler, self.scheduler.pool
        self.gen_stats.set_state(len(s.running), s.num_waiting, pool.num_used, pool.num_blocks, s.fragmentation(), s.preemptions)
        self.stats.set_queue(s.num_waiting, 0)

    async def close(self, grace_s: float) -> None:
        self._accepting = False
        self._wake.set()
        await drain(self._task, grace_s)
        self._thread.shutdown(wait=True)
        self.backend.unload()

"""The generation runner: decode a request once, then scheduler plan -> model step in a thread -> tokens streamed.

The event loop owns the scheduler; the step thread only runs the model. While a step runs, new
requests queue and cancelled ones are marked; both take effect at the next step, so a request joins
the running batch within one step of arriving. Token-level finishes (eos, stop ids, length) come
back from the scheduler's postprocess; the runner adds only text-level stop strings.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from server.backends.llm import torch_thread
from server.backends.llm.engine import LLMBackend
from server.backends.llm.tokenizer import IncrementalDetokenizer, StopStrings
from server.errors import (BackendError, DeadlineExceededError, FerryError, InvalidInputError, ModelNotFoundError,
                           ModelUnavailableError)
from server.observability import traffic
from server.observability.generation_metrics import GenerationStats
from server.observability.metrics import ModelStats
from server.runners import slow_steps
from server.runners.base import GENERATE, RunnerBase
from server.runners.sampling import sampling_params
from server.runners.step_isolation import StepOutcome, run_step_isolated
from server.scheduling.budget import ByteBudget
from server.scheduling.continuous import ContinuousScheduler
from server.scheduling.sequence import SamplingParams, Sequence, SeqStatus

log = logging.getLogger(__name__)
BYTES_PER_TOKEN = 8  # what a queued prompt is charged to the byte budgets per token (its KV cache is bounded apart)


@dataclass(slots=True)
class GenerationInput:
    """One generation request as a front door read it, nothing checked yet: the decoder's only input."""

    arrival_ns: int
    text: str | bytes | None = None  # the prompt as text (bytes: UTF-8) ...
    token_ids: list[int] | None = None  # ... or as token ids
    sampling: dict[str, Any] = field(default_factory=dict)  # raw values; see runners/sampling.py
    priority: int = 0
    timeout_us: int = 0  # the request's own timeout (0: none)
    rpc_deadline_ns: int | None = None  # the call's (or stream's) gRPC deadline, monotonic
    lora_name: str = ""  # a LoRA adapter of the model ("": the base); also read from sampling's `lora_name`


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A decoded, checked generation request: what `generate` runs."""

    prompt_ids: list[int]
    prompt_text: str
    sampling: SamplingParams
    priority: int
    deadline_ns: int | None
    arrival_ns: int
    adapter: Any = None  # the LoRA adapter it runs with (backends/llm/lora.LoraAdapter), None: the base model


@dataclass(frozen=True, slots=True)
class Logprob:
    token_id: int
    token: str  # the token's own text (a piece of a character may read as U+FFFD)
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's logprob and its `logprobs` most likely alternatives (sampler.py says which distribution)."""

    sampled: Logprob
    rank: int  # the sampled token's: 1 + how many tokens were more likely
    top: list[Logprob]


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
    logprobs: list[TokenLogprobs] | None = None  # one per token_ids entry, when the request asked


@dataclass(slots=True)
class _Stream:
    """Per-request state the runner keeps beside the scheduler's Sequence."""

    events: asyncio.Queue
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    scheduled_ns: int | None = None
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    done: bool = False


class GenerationRunner(RunnerBase):
    serves = GENERATE

    def __init__(self, name: str, version: int, backend: LLMBackend, scheduler: ContinuousScheduler,
                 stats: ModelStats, gen_stats: GenerationStats, default_max_tokens: int, budget: ByteBudget | None = None):
        super().__init__(name, version, stats, budget)
        self.backend = backend
        self.scheduler = scheduler
        self.gen_stats = gen_stats
        self.default_max_tokens = default_max_tokens
        self._ids = itertools.count()
        self._thread, self._owns_thread = torch_thread.step_thread(backend.device, f"{name}-{version}-llm")
        self._slow = slow_steps.SlowSteps(name)

    def throughput_first(self) -> None:
        """Offline work (`ferry batch` in-process): see ContinuousScheduler.throughput_first."""
        self.scheduler.throughput_first()

    def decode(self, given: GenerationInput) -> GenerationRequest:
        """The one generation decoder, for every entrance: prompt, sampling, priority, deadline."""
        text = given.text
        if isinstance(text, bytes):
            try:
                text = text.decode()
            except UnicodeDecodeError as exc:
                raise InvalidInputError(f"the prompt is not valid UTF-8: {exc}") from None
        raw = given.sampling
        lora_name = given.lora_name or raw.get("lora_name") or ""  # Triton's vLLM backend reads it there
        if "lora_name" in raw:
            raw = {k: v for k, v in raw.items() if k != "lora_name"}
        adapter = self.adapter(lora_name)
        sampling = sampling_params(raw, self.default_max_tokens)
        for name, value in (("priority", given.priority), ("timeout", given.timeout_us)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidInputError(f"parameter '{name}' must be a non-negative integer, got {value!r}")
        prompt = self.backend.encode_prompt(text if given.token_ids is None else None, given.token_ids)
        if sampling.constraint is not None:  # compiled (and cached) now: a schema it cannot take is a 400 before any work
            self.backend.start_guide(sampling.constraint)
        if given.sampling.get("max_tokens"):  # only an explicit max_tokens: the default is cut to fit
            self._check_length(len(prompt), sampling.max_tokens)
        own = given.arrival_ns + given.timeout_us * 1000 if given.timeout_us else None
        deadline = min((d for d in (own, given.rpc_deadline_ns) if d is not None), default=None)
        return GenerationRequest(prompt, text or "", sampling, given.priority, deadline, given.arrival_ns, adapter)

    def adapter(self, name) -> Any:
        """The registered LoRA adapter `name` (None for ""); an unknown one is NOT_FOUND."""
        if not name:
            return None
        if not isinstance(name, str):
            raise InvalidInputError(f"'lora_name' must be a string, got {name!r}")
        if self.backend.loras is None:
            raise ModelNotFoundError(f"LoRA adapter '{name}' is not loaded: model '{self.name}' serves no LoRA "
                                     "adapters (set its parameter enable_lora or lora_modules)")
        return self.backend.loras.get(name, self.name)

    def adapter_names(self) -> list[str]:
        return sorted(self.backend.loras.adapters) if self.backend.loras is not None else []

    async def load_adapter(self, name: str, path: str) -> None:
        """Register an adapter at run time (its folder is checked now, its weights read on first use)."""
        if self.backend.loras is None:
            raise InvalidInputError(f"model '{self.name}' serves no LoRA adapters (set its parameter enable_lora)")
        adapter = await asyncio.to_thread(self.backend.loras.read, name, path)
        self.backend.loras.register(adapter)

    def unload_adapter(self, name: str) -> None:
        """New requests naming it are refused at once; those already running finish with it."""
        if self.backend.loras is None:
            raise ModelNotFoundError(f"LoRA adapter '{name}' is not loaded: model '{self.name}' serves no LoRA adapters")
        self.backend.loras.unregister(name)

    def _check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        """vLLM's refusal, in its words (clients parse the numbers to trim their prompts): a prompt plus an
        explicit max_tokens past max_model_len is an error, never an answer silently cut short."""
        limit = self.scheduler.settings.max_model_len
        if prompt_tokens <= limit < prompt_tokens + max_tokens:  # a prompt alone too long: the scheduler's refusal
            raise InvalidInputError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Stream events for one request; leaving the iteration early (client gone) cancels it."""
        self._admit_check()
        prompt_ids = request.prompt_ids
        traffic.generate(self.name, request.arrival_ns, len(prompt_ids), request.sampling.max_tokens)  # --record-traffic
        nbytes = len(prompt_ids) * BYTES_PER_TOKEN
        self._take_bytes(nbytes, request.arrival_ns)
        try:
            async with contextlib.aclosing(self._stream(request, prompt_ids)) as events:  # closed now, not at GC
                async for event in events:
                    yield event
        finally:
            self._give_bytes(nbytes)

    async def _stream(self, request: GenerationRequest, prompt_ids: list[int]) -> AsyncIterator[GenerationEvent]:
        seq = Sequence(next(self._ids), list(prompt_ids), len(prompt_ids), request.sampling,
                       priority=request.priority or 1, arrival_ns=request.arrival_ns, deadline_ns=request.deadline_ns,
                       lora=request.adapter, lora_key=request.adapter.key if request.adapter is not None else b"")
        stream = _Stream(asyncio.Queue(), IncrementalDetokenizer(self.backend.tokenizer, prompt_ids),
                         StopStrings(request.sampling.stop))
        seq.handle = stream
        if request.sampling.constraint is not None:
            seq.guide = self.backend.start_guide(request.sampling.constraint)
        try:
            self.scheduler.submit(seq)
        except FerryError:
            self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=False, reason="REJECTED")
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

    def _abandon_all(self, error: ModelUnavailableError) -> None:
        for seq in self.scheduler.running + self.scheduler.waiting():
            if not seq.handle.done:
                self._fail(seq, error)

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
            self._mark_scheduled(plan, now)
            await self._step(loop, plan, now)
            del plan

    async def _step(self, loop, plan, now: int) -> None:
        """Run one step and hand out its tokens. A method of its own so that its locals (the step's
        sequences, their plan and outcome) are gone once it returns: the loop may idle for a long time
        after the last step, and a cancelled sequence must not stay alive until the next one."""
        outcome, timing = await loop.run_in_executor(self._thread, slow_steps.timed, run_step_isolated,
                                                     self.backend.step, plan)
        done = time.monotonic_ns()
        self._fail_alone(outcome)
        sampled, logprobs = outcome.sampled, self.backend.take_logprobs()
        before = [(seq, seq.num_tokens) for seq, _ in outcome.ran.entries]
        self.scheduler.postprocess(outcome.ran, sampled)
        if outcome.ran:
            self.stats.record_batch(len(sampled), len(outcome.ran.entries), 0, done - now, 0)
        for seq, length in before:
            new = seq.token_ids[length:]  # one token, or several when drafts were kept (speculative.py)
            for i, token in enumerate(new):
                if seq.cancelled or seq.handle.done:
                    break
                self._emit(seq, token, done, self._logprobs(logprobs.get(seq.seq_id), i), last=i == len(new) - 1)
        self._measured(outcome, now, timing)

    def _measured(self, outcome: StepOutcome, started_ns: int, timing: slow_steps.StepTiming) -> None:
        """Feed the step-time target what this whole iteration cost (what a decode waited between two
        tokens); a step re-run to isolate a failure is no measure of the normal cost."""
        ran = outcome.ran
        tokens, elapsed = ran.num_tokens, time.monotonic_ns() - started_ns
        self.gen_stats.observe_step(tokens, elapsed)
        self._slow.check(elapsed, self.scheduler.step_budget.cost.predict(ran.decodes, ran.prompt_tokens), timing,
                         tokens, len(ran.entries))
        if tokens and not outcome.reruns:
            self.scheduler.observe_step(ran, elapsed / 1e6)

    def _fail_alone(self, outcome: StepOutcome) -> None:
        """End the sequences the step raised on by themselves: their blocks go back, their callers get the error."""
        if outcome.reruns:
            self.gen_stats.count_reruns(outcome.reruns)
        for seq, exc in outcome.failed:
            log.error("model '%s': a step raised on sequence %d alone (found in %d re-runs); failing it",
                      self.name, seq.seq_id, outcome.reruns, exc_info=exc)
            self.scheduler.finish(seq, "error")
            if not seq.handle.done:
                self._fail(seq, exc if isinstance(exc, FerryError) else
                           BackendError(f"model '{self.name}' failed: {type(exc).__name__}: {exc}"))

    def _mark_scheduled(self, plan, now: int) -> None:
        for seq, _ in plan.entries:
            if seq.handle.scheduled_ns is None:
                seq.handle.scheduled_ns = now
                self.stats.record_queued(now - seq.arrival_ns)
                self.gen_stats.observe("queue_us", now - seq.arrival_ns)

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

    def _logprobs(self, per_token, i: int) -> list[TokenLogprobs] | None:
        """The sampler's (id, logprob) pairs of a step's `i`-th new token of a sequence, with each token's
        text, or None when not asked for."""
        if per_token is None or i >= len(per_token):
            return None
        raw = per_token[i]
        decode = self.backend.tokenizer.decode
        return [TokenLogprobs(Logprob(raw.token_id, decode([raw.token_id]), raw.logprob), raw.rank,
                              [Logprob(t, decode([t]), lp) for t, lp in raw.top])]

    def _emit(self, seq: Sequence, token: int, now: int, logprobs: list[TokenLogprobs] | None = None,
              last: bool = True) -> None:
        """Turn one sampled token into text; the scheduler already finished `seq` if its `last` token of
        the step ends it."""
        stream = seq.handle
        if stream.first_token_ns is None:
            stream.first_token_ns = now
            self.gen_stats.observe("ttft_us", now - seq.arrival_ns)
            self.gen_stats.count_tokens(seq.prompt_len, 1)
        else:
            self.gen_stats.observe("itl_us", now - stream.last_token_ns)
            self.gen_stats.count_tokens(0, 1)
        stream.last_token_ns = now
        finish = seq.finish_reason if last and seq.status is SeqStatus.FINISHED else None
        text, stopped = ("", False) if finish == "eos" else stream.stops.feed(stream.detokenizer.add(token))
        if stopped:  # a stop string: text-level, so the runner's to decide
            finish = "stop"
            self.scheduler.finish(seq, finish)
        if finish is None:
            stream.events.put_nowait(GenerationEvent([token], text, logprobs=logprobs))
            return
        if not stopped:  # release held text: an unfinished character, a possible stop-string start
            tail, stopped = stream.stops.feed(stream.detokenizer.flush())
            text += tail + ("" if stopped else stream.stops.flush())
        self._final(seq, finish, text, [token], now, logprobs)

    def _final(self, seq: Sequence, reason: str, text: str, tokens: list[int], now: int,
               logprobs: list[TokenLogprobs] | None = None) -> None:
        stream = seq.handle
        stream.done = True
        first = stream.first_token_ns or now
        self.stats.record_done(now - seq.arrival_ns, ok=True)
        self.gen_stats.observe("e2e_us", now - seq.arrival_ns)
        stream.events.put_nowait(GenerationEvent(
            tokens, text, reason, prompt_tokens=seq.prompt_len, completion_tokens=seq.num_output,
            queue_ms=((stream.scheduled_ns or now) - seq.arrival_ns) / 1e6, ttft_ms=(first - seq.arrival_ns) / 1e6,
            total_ms=(now - seq.arrival_ns) / 1e6, logprobs=logprobs))

    def _fail(self, seq: Sequence, error: FerryError) -> None:
        seq.handle.done = True
        self.stats.record_done(time.monotonic_ns() - seq.arrival_ns, ok=False,
                               reason="REJECTED" if isinstance(error, DeadlineExceededError) else "BACKEND")
        seq.handle.events.put_nowait(GenerationEvent([], "", error=error))

    def _publish(self) -> None:
        s, pool = self.scheduler, self.scheduler.pool
        self.gen_stats.set_state(len(s.running), s.num_waiting, pool.num_used, pool.num_blocks, s.fragmentation(), s.preemptions)
        self.gen_stats.set_prefix_cache(len(pool.cache), pool.cache.stats)
        self.gen_stats.set_shared_prefix_reads(self.backend.shared_prefix_reads)
        guides = getattr(self.backend, "guides", None)
        if guides is not None:
            self.gen_stats.set_guided(guides.stats)
        if s.speculator is not None:
            self.gen_stats.set_speculative(s.speculator.stats)
        if self.backend.loras is not None:
            self.gen_stats.set_lora(self.backend.loras.stats)
        self.stats.set_gauges(s.gauges())

    async def _shutdown(self) -> None:
        if self._owns_thread:
            self._thread.shutdown(wait=True)
        else:  # the shared CPU thread: let a step already handed to it end before the model goes
            await asyncio.get_running_loop().run_in_executor(self._thread, lambda: None)
        self.backend.unload()

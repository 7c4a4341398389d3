"""Continuous batching: which sequences advance in the next model step, and by how many tokens.

NOTE: there is no prefill phase and no decode phase. Every sequence has `num_computed` tokens in the
KV cache out of `num_tokens`; a step feeds each scheduled sequence its next `pending` tokens (a
decode is 1, a prompt or a recompute is many, cut to a chunk when the token budget runs out) and
samples a token for those that catch up. Running sequences are served first, most urgent first; the
budget left goes to waiting ones (priority, then arrival; preempted ones first within a priority).
When a running sequence needs a block and none is free, the least urgent running sequence (lowest
priority, most recently admitted) is preempted: its blocks are freed and it waits at the head of its
priority to be recomputed from its prompt plus what it already generated, so the client sees no gap
or duplicate. A step that preempted admits nothing new, and admission keeps a margin of free blocks
so a resumed sequence is not evicted again at once. With prefix caching, a waiting sequence is
admitted with the cached blocks of its longest cached prefix and `num_computed` past them: blocks
and token budget are counted for the rest only (a resumed sequence often finds its own blocks).
With a step-time target (`max_step_ms`, step_budget.py), prompt chunks get only what the target
leaves after the step's decodes (unless the decodes are few next to the prompts that could start:
a burst's onset), judged by the step cost the runner measures and passes in (`observe_step`); this
module reads no clock.
Every token-level finish (eos, a stop token id, max_tokens, max_model_len) is decided here,
in `postprocess`; the runner only adds text-level stops. eos and stop token ids end nothing within
the first `min_tokens` tokens (the sampler also keeps them from being chosen there). With a
speculator (speculative.py), decoding sequences are given drafts from what the step leaves, and
`postprocess` keeps only the drafts the model agreed with.
With LoRA adapters (a sequence's `lora_key`), at most `max_loras` distinct adapters run at once, as the
engine holds that many: a waiting sequence whose adapter would be one too many is passed over (it keeps
its place) for those behind it whose adapter is already running, or that use the base model.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from server.errors import InvalidInputError, QueueFullError
from server.scheduling.base import Gauges
from server.scheduling.kv_blocks import KVBlockPool
from server.scheduling.sequence import Sequence, SeqStatus
from server.scheduling.speculative import Speculator
from server.scheduling.step_budget import StepBudget


@dataclass(frozen=True, slots=True)
class ContinuousSettings:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    max_waiting: int = 1024
    admit_margin_blocks: int = 1
    eos_token_ids: frozenset[int] = frozenset()
    max_step_ms: float = 0.0  # step-time target (0: none, or the automatic one); see step_budget.py
    auto_step_target: float = 0.0  # with max_step_ms 0: that many times a full batch of decodes' cost (0: none)
    min_prefill_tokens: int = 32  # prompt tokens a step offers whatever the target
    max_loras: int = 0  # LoRA adapters running at once (the engine's resident slots); 0: no adapters served


@dataclass(slots=True)
class StepPlan:
    """What one model step computes: each sequence with the number of its tokens to feed. A sequence in
    `drafts` is fed its pending token, then those draft tokens (counted in its entry's number)."""

    entries: list[tuple[Sequence, int]]
    drafts: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> draft tokens (speculative.py)
    decodes: int = field(init=False)  # entries fed their one pending token (with drafts, if any, beside it)

    def __post_init__(self) -> None:
        self.decodes = sum(1 for seq, _ in self.entries if seq.pending == 1)  # counted before the step runs

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    @property
    def prompt_tokens(self) -> int:
        """Tokens fed beyond the decodes' one each: prompt chunks and drafts."""
        return self.num_tokens - self.decodes

    def __bool__(self) -> bool:
        return bool(self.entries)


class ContinuousScheduler:
    def __init__(self, settings: ContinuousSettings, pool: KVBlockPool, speculator: Speculator | None = None):
        self.settings = settings
        self.pool = pool
        self.speculator = speculator
        self.running: list[Sequence] = []
        self._waiting: list[tuple[int, int, int, Sequence]] = []  # heap: (priority, 0 if preempted, order, seq)
        self._order = itertools.count()
        self._admissions = itertools.count()
        self.preemptions = 0
        self.step_budget = StepBudget(settings.max_step_ms, settings.min_prefill_tokens, auto=settings.auto_step_target,
                                      auto_tokens=settings.max_num_seqs)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting(self) -> list[Sequence]:
        return [entry[-1] for entry in sorted(self._waiting)]

    def submit(self, seq: Sequence) -> None:
        """Admit to the waiting queue, or refuse at once (too long, queue full)."""
        limit = self.settings.max_model_len
        if seq.num_tokens >= limit:
            raise InvalidInputError(f"prompt has {seq.num_tokens} tokens; max_model_len is {limit}")
        step = self.settings.max_num_batched_tokens
        needed = self.pool.peak_blocks(min(seq.num_tokens + seq.sampling.max_tokens, limit), step)
        if needed > self.pool.num_blocks:
            raise InvalidInputError(
                f"prompt plus max_tokens needs {needed} KV blocks but the pool has {self.pool.num_blocks}; "
                "lower max_tokens or give the model more KV blocks")
        if len(self._waiting) >= self.settings.max_waiting:
            raise QueueFullError(f"generation queue is full ({self.settings.max_waiting} waiting); retry later")
        self._push_waiting(seq, preempted=False)

    def _push_waiting(self, seq: Sequence, preempted: bool) -> None:
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (seq.priority, 0 if preempted else 1, next(self._order), seq))

    def expire(self, now_ns: int) -> list[Sequence]:
        """Remove waiting sequences whose deadline passed (they never got to run, or must not resume)."""
        expired = [e[-1] for e in self._waiting if e[-1].deadline_ns is not None and now_ns >= e[-1].deadline_ns]
        if expired:
            gone = set(map(id, expired))
            self._waiting = [e for e in self._waiting if id(e[-1]) not in gone]
            heapq.heapify(self._waiting)
            for seq in expired:
                self._finish(seq, "deadline")
        return expired

    def drop_cancelled(self) -> list[Sequence]:
        """Free every cancelled sequence, waiting or running; called at the start of each step."""
        dropped = [s for s in self.running if s.cancelled] + [e[-1] for e in self._waiting if e[-1].cancelled]
        if dropped:
            self.running = [s for s in self.running if not s.cancelled]
            self._waiting = [e for e in self._waiting if not e[-1].cancelled]
            heapq.heapify(self._waiting)
            for seq in dropped:
                self._finish(seq, "cancelled")
        return dropped

    def throughput_first(self) -> None:
        """Drop the automatic step-time target: for offline work (`ferry batch`), where nobody waits on
        a token, a running sequence that ends is replaced by a waiting one in the very next step, however
        long its prompt makes that step. A target the model's config sets (max_step_ms) stays."""
        if not self.settings.max_step_ms:
            self.step_budget.auto = 0.0

    def observe_step(self, plan: StepPlan, step_ms: float) -> None:
        """The runner's measurement of a step that ran `plan`: feeds the step-time target."""
        self.step_budget.cost.observe(plan.decodes, plan.prompt_tokens, step_ms)

    def schedule(self) -> StepPlan:
        budget = self.settings.max_num_batched_tokens
        entries: list[tuple[Sequence, int]] = []
        self.running.sort(key=lambda s: (s.priority, s.admitted))
        decoding = sum(1 for s in self.running if s.pending == 1)
        prefill = self.step_budget.prefill_tokens(decoding, budget, self._starting())  # for prompt chunks
        budget, prefill, preempted = self._schedule_running(entries, budget, prefill)
        if preempted:
            return StepPlan(entries)
        budget, prefill = self._admit(entries, budget, prefill)
        if self.speculator is None:
            return StepPlan(entries)
        # Drafts are extra tokens like a prompt chunk's: they take what the step's target leaves.
        room = min(budget, prefill)
        return StepPlan(entries, self.speculator.draft(entries, room, self._reserve, self.settings.max_model_len))

    def _starting(self) -> int:
        """Sequences a prompt chunk could serve this step: running ones mid-prompt, and waiting ones up
        to the free sequence slots (more waiting cannot be admitted now, so they gain nothing from it)."""
        slots = max(0, self.settings.max_num_seqs - len(self.running))
        return min(len(self._waiting), slots) + sum(1 for s in self.running if s.pending > 1)

    def _schedule_running(self, entries: list, budget: int, prefill: int) -> tuple[int, int, bool]:
        preempted = False
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            chunk = seq.pending > 1
            n = min(seq.pending, budget, prefill if chunk else 1)
            if n == 0:
                continue  # a prompt the step's target leaves no room for: it goes on next step
            while not self.pool.can_hold(seq, seq.num_computed + n):
                victim = queue.pop() if queue else seq  # the least urgent not yet scheduled
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            self.pool.allocate(seq, seq.num_computed + n)
            entries.append((seq, n))
            budget -= n
            prefill -= n if chunk else 0
        return budget, prefill, preempted

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        if not self.pool.can_hold(seq, num_tokens):
            return False
        self.pool.allocate(seq, num_tokens)
        return True

    def _admit(self, entries: list, budget: int, prefill: int) -> tuple[int, int]:
        passed: list[tuple] = []  # waiting entries whose adapter cannot run yet (max_loras), pushed back after
        try:
            return self._admit_waiting(entries, budget, prefill, passed)
        finally:
            for entry in passed:
                heapq.heappush(self._waiting, entry)

    def _admit_waiting(self, entries: list, budget: int, prefill: int, passed: list) -> tuple[int, int]:
        # The margin protects running sequences from at-once re-eviction; with none running, a request
        # that needs the whole pool must still be admitted or it would block the queue forever.
        adapters = {s.lora_key for s in self.running if s.lora_key}
        while self._waiting and min(budget, prefill) > 0 and len(self.running) < self.settings.max_num_seqs:
            seq = self._waiting[0][-1]
            if seq.lora_key and seq.lora_key not in adapters and len(adapters) >= self.settings.max_loras:
                passed.append(heapq.heappop(self._waiting))
                continue
            hit = self.pool.match(seq)
            cached = len(hit) * self.pool.block_size
            n = min(seq.num_tokens - cached, budget, prefill)  # only what the cache does not hold is computed
            margin = self.settings.admit_margin_blocks if self.running else 0
            if not self.pool.can_admit(seq, cached + n, hit, margin):
                break
            heapq.heappop(self._waiting)
            self.pool.admit(seq, cached + n, hit)
            seq.num_computed = cached
            seq.status = SeqStatus.RUNNING
            seq.admitted = next(self._admissions)
            self.running.append(seq)
            if seq.lora_key:
                adapters.add(seq.lora_key)
            entries.append((seq, n))
            budget -= n
            prefill -= n
        return budget, prefill

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq)
        seq.num_computed = 0  # recompute prompt + generated tokens when resumed
        seq.preemptions += 1
        self.preemptions += 1
        self._push_waiting(seq, preempted=True)

    def postprocess(self, plan: StepPlan, sampled: dict[int, int | list[int]]) -> list[Sequence]:
        """Fold a finished step back in: advance computed counts and append sampled tokens. A sequence
        whose new token ends it leaves `running`, gives back its blocks and is returned, with
        `finish_reason` set. Cancelled sequences are left to `drop_cancelled`. A drafted sequence's
        value is the model's choice after each token it was fed (see `_verify`)."""
        finished = []
        for seq, n in plan.entries:
            if seq.status is not SeqStatus.RUNNING:
                continue  # cancelled or finished while the step ran: its output is dropped
            if seq.seq_id in plan.drafts:
                if self._verify(seq, plan.drafts[seq.seq_id], sampled.get(seq.seq_id)):
                    finished.append(seq)
                continue
            seq.num_computed += n
            self.pool.cache_full_blocks(seq)
            self.pool.release_passed(seq)
            token = sampled.get(seq.seq_id)
            if token is None:
                continue
            seq.token_ids.append(token)
            reason = None if seq.cancelled else self._finish_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _verify(self, seq: Sequence, drafts: list[int], choices: list[int] | None) -> bool:
        """Append the tokens a drafted step yields, up to the first that ends the sequence; keep K/V and
        blocks for the tokens kept only. True when the sequence finished."""
        if choices is None:
            return False
        fed = seq.num_computed  # the pending token sits here, the drafts after it
        tokens = self.speculator.verify(drafts, choices)
        reason = None
        for token in tokens:
            seq.token_ids.append(token)
            reason = None if seq.cancelled else self._finish_reason(seq, token)
            if reason is not None:
                break
        # K/V is right for the pending token and every kept draft: all but the last token kept (the
        # model's own choice, fed next step), or every token up to a finish that cut the kept drafts.
        seq.num_computed = min(seq.num_tokens, fed + len(tokens))
        self.pool.cache_full_blocks(seq)
        self.pool.release_passed(seq)
        if reason is not None:
            self.finish(seq, reason)
            return True
        self.pool.trim(seq, seq.num_tokens)
        return False

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling
        if seq.num_output > params.min_tokens:  # the sampler masks them before; this holds whatever it chose
            if token in self.settings.eos_token_ids and not params.ignore_eos:
                return "eos"
            if token in params.stop_token_ids:
                return "stop"
        if seq.num_output >= params.max_tokens or seq.num_tokens >= self.settings.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence (length, stop, eos, deadline) and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.pool.free(seq)

    def gauges(self) -> Gauges:
        return Gauges(pending=self.num_waiting)

    def fragmentation(self) -> float:
        return self.pool.fragmentation(self.running)

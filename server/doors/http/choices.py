"""OpenAI's `n` and `best_of`: several completions of one prompt, started so the prompt is computed once.

The first choice starts alone; once its first token is out, its prompt's full KV blocks are in the
prefix cache (postprocess caches them after the prefill step), so the other choices are admitted on
cached blocks and compute only the prompt's last partial block: one prefill, n decodes. Each choice
is its own sequence: a seeded request gives choice i the seed `seed + i`, so a rerun reproduces every
choice while the choices still differ from one another. `best_of` runs that many and keeps the `n`
whose sampled tokens have the highest cumulative logprob (vLLM's and OpenAI's ranking).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from server.errors import InvalidInputError
from server.runners.generation import GenerationEvent, GenerationRequest
from server.doors.http import streaming

MAX_CHOICES = 128  # OpenAI's limit on n
_SEED_LIMIT = 2**63


@dataclass(frozen=True, slots=True)
class ChoiceCounts:
    n: int = 1  # choices answered
    best_of: int = 1  # choices generated (>= n)

    @property
    def ranked(self) -> bool:
        return self.best_of > self.n


@dataclass(slots=True)
class Choice:
    """One finished choice: its text pieces, logprobs, and final event."""

    index: int
    pieces: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    last: GenerationEvent | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry.sampled.logprob for entry in self.logprobs)


def counts(body: dict, completions: bool) -> ChoiceCounts:
    """`n` and (completions only) `best_of` as OpenAI defines them, checked; refusals are 400s."""
    n = _count(body, "n", 1)
    best_of = _count(body, "best_of", n) if completions else n
    if not completions and body.get("best_of") not in (None, 1):
        raise InvalidInputError("'best_of' is a /v1/completions parameter; chat completions take 'n' only")
    if best_of < n:
        raise InvalidInputError(f"'best_of' ({best_of}) must be greater than or equal to 'n' ({n})")
    if best_of > n and body.get("stream"):
        raise InvalidInputError("'best_of' cannot be used with 'stream': the best choices are known only at the end")
    return ChoiceCounts(n, best_of)


def _count(body: dict, key: str, default: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHOICES:
        raise InvalidInputError(f"'{key}' must be an integer within [1, {MAX_CHOICES}], got {value!r}")
    return value


def variants(request: GenerationRequest, how_many: int, ranked: bool) -> list[GenerationRequest]:
    """One request per choice: seeds spread (seed + i), and the sampled tokens' logprobs kept for ranking."""
    sampling = request.sampling
    if ranked and sampling.logprobs is None:
        sampling = replace(sampling, logprobs=0)
    out = []
    for i in range(how_many):
        seed = None if sampling.seed is None else (sampling.seed + i) % _SEED_LIMIT
        out.append(replace(request, sampling=replace(sampling, seed=seed)))
    return out


async def start(runner, requests: list[GenerationRequest]) -> list[streaming.Generation]:
    """Start every choice, the first alone until its prompt is cached; errors before any answer is sent."""
    started: list[streaming.Generation] = []
    try:
        started.append(await streaming.start(runner, requests[0]))
        rest = await asyncio.gather(*(streaming.start(runner, r) for r in requests[1:]), return_exceptions=True)
        failed = next((r for r in rest if isinstance(r, BaseException)), None)
        started += [r for r in rest if not isinstance(r, BaseException)]
        if failed is not None:
            raise failed
    except BaseException:
        for generation in started:
            await generation.close()
        raise
    return started


async def collect(generations: list[streaming.Generation]) -> list[Choice]:
    """Every choice run to its end, concurrently."""

    async def one(index: int, generation: streaming.Generation) -> Choice:
        choice = Choice(index)
        async for event in generation.events():
            choice.pieces.append(event.text)
            choice.logprobs.extend(event.logprobs or [])
            choice.last = event
        return choice

    tasks = [asyncio.ensure_future(one(i, g)) for i, g in enumerate(generations)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _stop(tasks, generations)


def best(choices: list[Choice], n: int) -> list[Choice]:
    """The `n` choices of highest cumulative logprob, renumbered 0..n-1 in that order."""
    kept = sorted(choices, key=lambda c: c.cumulative_logprob, reverse=True)[:n]
    for index, choice in enumerate(kept):
        choice.index = index
    return kept


async def merged(generations: list[streaming.Generation]) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """Every choice's events as they come, tagged with the choice's index; closing this closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, generation: streaming.Generation) -> None:
        try:
            async for event in generation.events():
                await queue.put((index, event))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((index, exc))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    left = len(tasks)
    try:
        while left:
            index, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        await _stop(tasks, generations)


async def _stop(tasks: list[asyncio.Future], generations: list[streaming.Generation]) -> None:
    """Whatever still runs (a choice failed, the client left) is cancelled and its sequence freed."""
    for task in tasks:
        task.cancel()
    with contextlib.suppress(BaseException):
        await asyncio.gather(*tasks, return_exceptions=True)
    for generation in generations:
        await generation.close()

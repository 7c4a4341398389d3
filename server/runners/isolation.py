"""A batch that fails is split until the requests that make it fail are found; the rest are answered.

Batching runs strangers' requests in one backend call, so one malformed request must not fail the
others (Triton fails the whole batch here). When a batch of several requests fails, it runs again as
two halves, recursively, on the same instance: one bad request among n costs at most 2·log2(n)
extra runs, each smaller than the last, and only on the failure path. A request that fails on its
own gets the error; every other request gets the answers of the part it ran in.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from server.errors import FerryError
from server.request import Batch, InferRequest
from server.worker import BatchResult

RunPart = Callable[[Batch], Awaitable[BatchResult]]


@dataclass(slots=True)
class Outcome:
    """What running a batch came to, part by part."""

    answered: list[tuple[Batch, BatchResult]] = field(default_factory=list)  # parts that ran
    failed: list[tuple[InferRequest, FerryError]] = field(default_factory=list)  # requests that fail alone
    reruns: int = 0  # runs beyond the first, spent finding the failing requests


async def run_isolated(run: RunPart, batch: Batch, describe: Callable[[Exception], FerryError]) -> Outcome:
    """Run `batch`; on failure, run its halves (depth first, in batch order) until each failure is alone.

    `describe` turns an unexpected exception into the error the request's caller sees.
    """
    outcome, parts = Outcome(), [batch]
    while parts:
        part = parts.pop()
        try:
            outcome.answered.append((part, await run(part)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever failed, it fails this part only
            error = exc if isinstance(exc, FerryError) else describe(exc)
            if len(part.requests) == 1:
                outcome.failed.append((part.requests[0], error))
                continue
            half = len(part.requests) // 2
            parts += [_part(part, half, None), _part(part, 0, half)]  # popped first half first
            outcome.reruns += 2
    return outcome


def _part(batch: Batch, start: int, stop: int | None) -> Batch:
    return Batch(batch.requests[start:stop], batch.batched, batch.bucket)


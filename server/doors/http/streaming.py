"""Running one generation for an HTTP caller: errors before the first byte, SSE framing after it.

`start` waits for the first event before anything is sent, so a refusal (bad sampling value, full
queue, unknown model) still gets its own status code; once streaming, an error can only travel as
an event. Leaving the stream (the client disconnected: Starlette cancels the body iterator) closes
the runner's iterator at once, which cancels the sequence and frees its KV blocks.
"""

from __future__ import annotations

import contextlib
import json
from typing import AsyncIterator

from server.runners.generation import GenerationEvent, GenerationRequest

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not hold events back


class Generation:
    """One started generation: its first event, and the rest as they come."""

    def __init__(self, first: GenerationEvent, events: AsyncIterator[GenerationEvent]):
        self.first, self._events = first, events

    async def events(self) -> AsyncIterator[GenerationEvent]:
        async with contextlib.aclosing(self._events):
            yield self.first
            if self.first.finish_reason is not None:
                return
            async for event in self._events:
                yield event

    async def close(self) -> None:
        """End the generation now (its sequence is cancelled and its blocks freed) if it is still running."""
        await self._events.aclose()

    async def collect(self) -> tuple[str, GenerationEvent]:
        """All the text, and the final event (usage, finish reason)."""
        pieces, last = [], self.first
        async for event in self.events():
            pieces.append(event.text)
            last = event
        return "".join(pieces), last


async def start(runner, request: GenerationRequest) -> Generation:
    events = runner.generate(request)
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    return Generation(first, events)


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()

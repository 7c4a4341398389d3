"""Run a validated file through one engine (in-process or remote) with a bounded number in flight.

The input is streamed: a line is read only when a slot is free, so memory holds `in_flight`
requests however large the file. Enough slots keep the engine full (generation admits as fast as
its KV cache allows; the scheduler's queue takes the rest). Answers are written as they complete,
in completion order; each custom_id appears once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from typing import Protocol

from server.batch.output import AnswerWriter, answer_line, parse_body
from server.batch.progress import Tally
from server.batch.requests import Line

log = logging.getLogger("ferry.batch")
DEFAULT_IN_FLIGHT = 256
SHOWN_UNANSWERED = 5  # unanswered requests logged one by one before they are only counted
RETRY_BACKOFF_S = (0.5, 1.0, 2.0)  # waits before each retry of a 503


class Unanswered(Exception):
    """No HTTP answer came back for a request (a remote server unreachable); nothing is written for it."""


class Sender(Protocol):
    async def post(self, path: str, body: bytes) -> tuple[int, bytes]: ...


async def run_lines(sender: Sender, lines: Iterable[Line], writer: AnswerWriter, tally: Tally,
                    in_flight: int = DEFAULT_IN_FLIGHT, tick=lambda: None) -> None:
    """Answer every line through `sender`, appending each answer to `writer` as it comes.

    Cancelled (Ctrl-C), it cancels what is in flight and writes nothing more: those lines are left
    for the rerun, as after a kill."""
    slots = asyncio.Semaphore(in_flight)
    running: set[asyncio.Task] = set()
    failures: list[BaseException] = []

    async def one(line: Line) -> None:
        try:
            status, raw = await _post(sender, line)
            body = parse_body(raw)
            writer.write(answer_line(line.custom_id, status, body))
            tally.add(status, body)
        except Unanswered as exc:
            tally.unanswered += 1
            if tally.unanswered <= SHOWN_UNANSWERED:
                log.error("line %d (custom_id %r): no answer, left for a rerun: %s", line.number, line.custom_id, exc)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - a bug here stops the run; raised below
            failures.append(exc)
        finally:
            slots.release()
            tick()

    try:
        for line in lines:
            await slots.acquire()
            if failures:
                break
            task = asyncio.create_task(one(line))
            running.add(task)
            task.add_done_callback(running.discard)
        if running:
            await asyncio.wait(set(running))
    except asyncio.CancelledError:
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        raise
    if failures:
        raise failures[0]


async def _post(sender: Sender, line: Line) -> tuple[int, bytes]:
    """One request; 503 (a full queue, a model not ready, a draining server) is retried, then left unanswered,
    so a passing condition never becomes a final answer in OUTPUT."""
    body = json.dumps(line.body).encode()
    for backoff_s in (*RETRY_BACKOFF_S, None):
        status, raw = await sender.post(line.url, body)
        if status != 503:
            return status, raw
        if backoff_s is not None:
            await asyncio.sleep(backoff_s)
    raise Unanswered(f"503 after {len(RETRY_BACKOFF_S)} retries: {raw[:200].decode('utf-8', 'replace')}")

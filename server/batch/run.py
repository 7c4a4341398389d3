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


class Unanswered(Exception):
    """No HTTP answer came back for a request (a remote server unreachable); nothing is written for it."""


class Sender(Protocol):
    async def post(self, path: str, body: bytes) -> tuple[int, bytes]: ...


async def run_lines(sender: Sender, lines: Iterable[Line], writer: AnswerWriter, tally: Tally,
                    in_flight: int = DEFAULT_IN_FLIGHT, tick=lambda: None) -> None:
    """Answer every line through `sender`, appending each answer to `writer` as it comes."""
    slots = asyncio.Semaphore(in_flight)
    running: set[asyncio.Task] = set()
    failures: list[BaseException] = []

    async def one(line: Line) -> None:
        try:
            status, raw = await sender.post(line.url, json.dumps(line.body).encode())
            body = parse_body(raw)
            writer.write(answer_line(line.custom_id, status, body))
            tally.add(status, body)
        except Unanswered as exc:
            tally.unanswered += 1
            if tally.unanswered <= SHOWN_UNANSWERED:
                log.error("line %d (custom_id %r): no answer, left for a rerun: %s", line.number, line.custom_id, exc)
        except BaseException as exc:  # noqa: BLE001 - a bug here stops the run; raised below
            failures.append(exc)
        finally:
            slots.release()
            tick()

    for line in lines:
        await slots.acquire()
        if failures:
            break
        task = asyncio.create_task(one(line))
        running.add(task)
        task.add_done_callback(running.discard)
    if running:
        await asyncio.wait(set(running))
    if failures:
        raise failures[0]

"""Run a validated file through one engine (in-process or remote) with a bounded number in flight.

The input is streamed: a line is read only when a slot is free, so memory holds `in_flight`
requests however large the file. Enough slots keep the engine full (generation admits as fast as
its KV cache allows; the scheduler's queue takes the rest). Answers are written as they complete,
in completion order; each custom_id appears once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Protocol

from server.batch.output import AnswerWriter, answer
from server.batch.progress import Tally
from server.batch.requests import Line

log = logging.getLogger("ferry.batch")
DEFAULT_IN_FLIGHT = 256
SHOWN_UNANSWERED = 5  # unanswered requests logged one by one before they are only counted
RETRY_BACKOFF_S = (0.5, 1.0, 2.0)  # waits before each retry of a 503


class Unanswered(Exception):
    """No HTTP answer came back for a request (a remote server unreachable); nothing is written for it."""


class Sender(Protocol):
    async def post(self, path: str, body: bytes) -> tuple[int, bytes, bool]:
        """(status, answer, trusted): trusted when the answer is JSON from Ferry's encoder in this process."""


async def run_lines(sender: Sender, lines: Iterable[Line], writer: AnswerWriter, tally: Tally,
                    in_flight: int = DEFAULT_IN_FLIGHT, tick=lambda: None) -> None:
    """Answer every line through `sender`, appending each answer to `writer` as it comes.

    Cancelled (Ctrl-C), it cancels what is in flight and writes nothing more: those lines are left
    for the rerun, as after a kill."""
    slots = asyncio.Semaphore(in_flight)
    running: set[asyncio.Task] = set()
    failures: list[BaseException] = []
    flushing = _Flushing(writer)

    async def one(line: Line) -> None:
        try:
            status, raw, trusted = await _post(sender, line)
            text, tokens = answer(line.custom_id, status, raw, trusted)
            writer.write_line(text)
            flushing.soon()
            tally.add(status, tokens)
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
    finally:
        flushing.now()  # answers already made are written, whatever ended the run
    if failures:
        raise failures[0]


class _Flushing:
    """Gathered answer lines reach the file within the writer's FLUSH_S even when no further answer comes."""

    def __init__(self, writer):
        self.writer, self.timer = writer, None

    def soon(self) -> None:
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(AnswerWriter.FLUSH_S, self.now)

    def now(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.writer.flush()


async def _post(sender: Sender, line: Line) -> tuple[int, bytes, bool]:
    """One request; 503 (a full queue, a model not ready, a draining server) is retried, then left unanswered,
    so a passing condition never becomes a final answer in OUTPUT."""
    body = line.data
    for backoff_s in (*RETRY_BACKOFF_S, None):
        status, raw, trusted = await sender.post(line.url, body)
        if status != 503:
            return status, raw, trusted
        if backoff_s is not None:
            await asyncio.sleep(backoff_s)
    raise Unanswered(f"503 after {len(RETRY_BACKOFF_S)} retries: {raw[:200].decode('utf-8', 'replace')}")

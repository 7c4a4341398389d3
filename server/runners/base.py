"""The seam every served model version lives behind: the `Runner` protocol and its shared lifecycle.

The registry and the front doors hold runners only through `Runner`: they start it, close it with a
grace period, read its stats, and ask what it serves (INFER: one answer per request, GENERATE: a
stream of tokens). A new model kind is a new runner built by factory.py; nothing above changes.
`RunnerBase` holds what every runner shares: the loop task, admission on/off, drain within a grace
period, and answering everyone left when the loop ends however it ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Protocol

from server.errors import ModelUnavailableError, QueueFullError
from server.observability.metrics import ModelStats
from server.scheduling.budget import ByteBudget
from server.scheduling.sequence_slots import SequenceSlots

log = logging.getLogger(__name__)

INFER, GENERATE, DECOUPLED = "infer", "generate", "decoupled"  # DECOUPLED: 0..N responses per request
_LOADS = itertools.count()


class Runner(Protocol):
    name: str
    version: int
    stats: ModelStats
    serves: str  # INFER, GENERATE or DECOUPLED: which front-door calls it answers
    load_id: int  # tells one load of a version from another (a reload may bring new weights)

    def start(self) -> None:
        """Start serving, on the running event loop."""

    async def close(self, grace_s: float) -> None:
        """Stop admitting; finish admitted work within `grace_s`; answer the rest UNAVAILABLE; release."""


class RunnerBase:
    """Lifecycle shared by runners: subclasses give `_loop`, `_abandon_all` and `_shutdown`."""

    serves = ""

    def __init__(self, name: str, version: int, stats: ModelStats, budget: ByteBudget | None = None):
        self.name, self.version = name, version
        self.load_id = next(_LOADS)
        self.stats = stats
        self.budget = budget or ByteBudget(0, f"model '{name}' version {version}")
        self._wake = asyncio.Event()
        self._accepting = True
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"{self.serves}-{self.name}-{self.version}")
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """However the loop ended (drained, cut off after the grace period, crashed), answer everyone left."""
        self._accepting = False
        if not task.cancelled() and task.exception() is not None:
            log.error("model '%s': %s loop failed", self.name, self.serves, exc_info=task.exception())
        self._abandon_all(ModelUnavailableError(
            f"model '{self.name}' version {self.version} stopped before this request finished"))

    def _admit_check(self) -> None:
        if not self._accepting:
            raise ModelUnavailableError(f"model '{self.name}' version {self.version} has stopped accepting requests")

    def _take_bytes(self, nbytes: int, arrival_ns: int) -> None:
        """Charge an admitted request's data to the byte budgets, or refuse it (UNAVAILABLE) as a full queue is."""
        try:
            self.budget.take(nbytes)
        except QueueFullError:
            self.stats.record_done(time.monotonic_ns() - arrival_ns, ok=False, reason="REJECTED")
            raise
        self.stats.queued_bytes = self.budget.held

    def _give_bytes(self, nbytes: int) -> None:
        """The request is answered (whatever the outcome): its data no longer counts."""
        self.budget.give(nbytes)
        self.stats.queued_bytes = self.budget.held

    async def close(self, grace_s: float) -> None:
        self._accepting = False
        self._wake.set()
        await drain(self._task, grace_s)
        await self._shutdown()

    async def model_ready(self) -> bool:
        """Ready as far as its backends' own checks say (Triton's is_ready, asked on threads: it may block)."""
        checked = [b for b in self._backends() if b.checks_ready]
        if not checked:
            return True
        return all(await asyncio.gather(*(asyncio.to_thread(b.is_ready) for b in checked)))

    def _backends(self) -> list:
        return []

    def _release_idle(self, slots: SequenceSlots, busy: set) -> list:
        """A stateful model's sequences idle past its limit (none with a request in flight), released and
        logged; their ids."""
        released = slots.expire(time.monotonic_ns(), busy)
        for cid in released:
            log.info("model '%s': sequence %r released after %.3f s idle", self.name, cid, slots.idle_ns / 1e9)
        return released

    async def _sleep(self, wake_ns: int | None) -> None:
        """Until `_wake` is set or, when given, the monotonic time `wake_ns` comes."""
        timeout = None if wake_ns is None else max(0.0, (wake_ns - time.monotonic_ns()) / 1e9)
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass

    async def _loop(self) -> None:
        raise NotImplementedError

    def _abandon_all(self, error: ModelUnavailableError) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        """After the drain: give back threads, instances and device memory."""


async def drain(loop_task: asyncio.Task | None, grace_s: float) -> None:
    """Wait for a runner's loop to finish its admitted work; past the grace period, stop it."""
    if loop_task is None:
        return
    try:
        await asyncio.wait_for(asyncio.shield(loop_task), grace_s)
    except TimeoutError:
        loop_task.cancel()

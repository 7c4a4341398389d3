"""On-demand model control: a model loads on its first inference request and the least recently used
idle models leave when the memory budget needs their room.

Requests hold a lease on their model (`lease`) from the moment they arrive until they are answered:
a model with a lease is busy and never evicted. The first lease on a cold model starts its load;
every other request for it waits on the same load, within its own deadline. Loads run one at a time,
so each one's measured footprint (server/repository/footprint.py) is its own and each eviction
decision sees the last one's result; the hottest model waiting goes next (`LoadTurns`), so a hot model
that had to leave is not stuck behind a queue of one-off tail loads (under bench/many_models.py's Zipf
load the loader is busy most of the time). A load is patient for a moment (`patience_s`) when the models it
should evict are still busy: it waits for a colder busy model to go idle rather than evict a hotter idle
one, and for busy models to free the room rather than refuse the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from server.errors import DeadlineExceededError, ModelUnavailableError, ResourceExhaustedError
from server.repository.footprint import HOST, Footprint, declared, shown_size
from server.repository.registry import Registry
from server.repository.residency import Residency

log = logging.getLogger("ferry")
STARVE_S = 2.0  # the longest a load waits while hotter ones go first
LRU, OVER_BUDGET = "lru", "over_budget"  # why a model was evicted: room for a load, or a load measured larger than expected


@dataclass(slots=True)
class LoadCounts:
    """What /metrics shows of loads and evictions, by model."""

    loads: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    load_seconds: Counter[str] = field(default_factory=Counter)
    evictions: Counter[tuple[str, str]] = field(default_factory=Counter)  # (model, why)
    waiting: Counter[str] = field(default_factory=Counter)  # requests waiting for their model's load now


class OnDemand:
    def __init__(self, registry: Registry, residency: Residency, patience_s: float = 1.0):
        self.registry, self.residency = registry, residency
        self.patience_s = patience_s  # how long a load waits for busy residents before it settles for the idle ones
        self.counts = LoadCounts()
        self._users: Counter[str] = Counter()  # requests arrived and not yet answered, per model
        self._loads: dict[str, asyncio.Task] = {}  # the one load in progress per model
        self._turns = LoadTurns()
        self._sizes: dict[str, Footprint] = {}  # each model's last measured footprint: its next load's estimate
        self._trims: set[asyncio.Task] = set()  # evictions after a load measured larger than expected
        self._released = asyncio.Event()  # set whenever a model's last request is answered

    @contextlib.asynccontextmanager
    async def lease(self, name: str, remaining_s: float | None = None):
        """Hold `name` resident while the request is served; load it first if it is cold."""
        self._users[name] += 1
        try:
            if self.registry.is_cold(name):
                await self._wait_loaded(name, remaining_s)
            self.residency.touch(name)
            yield
        finally:
            self._users[name] -= 1
            if not self._users[name]:
                del self._users[name]
                self._released.set()

    def idle(self, name: str) -> bool:
        """Nothing queued or executing: no request holds a lease, no batch waits in its runners."""
        if self._users[name] or name in self._loads:
            return False
        return all(mv.runner is None or not mv.runner.stats.pending for mv in self.registry.all_versions(name))

    async def _wait_loaded(self, name: str, remaining_s: float | None) -> None:
        task = self._loads.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._bring_in(name), name=f"load-on-demand-{name}")
            self._loads[name] = task
            task.add_done_callback(lambda _, n=name: self._loads.pop(n, None))
            task.add_done_callback(_consume)
        self.counts.waiting[name] += 1
        try:
            await asyncio.wait_for(asyncio.shield(task), remaining_s)  # a waiter that gives up leaves the load running
        except TimeoutError:
            raise DeadlineExceededError(f"model '{name}': the request's deadline passed while the model was loading on "
                                        "demand (its first request loads it; raise the deadline for cold models)") from None
        finally:
            self.counts.waiting[name] -= 1

    async def _bring_in(self, name: str) -> None:
        async with self._turns.turn(self.residency.heat(name)):
            if not self.registry.is_cold(name):
                return  # loaded by the time this load's turn came
            need = self._expected(name)
            for victim in await self._victims(name, need):
                await self._evict(victim, LRU, f"to make room for model '{name}' ({need.shown()} expected)")
            began = time.monotonic()
            error = await self.registry.load_cold(name)
            seconds = time.monotonic() - began
            self.counts.load_seconds[name] += seconds
            if error:
                self.counts.failures[name] += 1
                log.error("model '%s' failed to load on demand after %.2f s: %s", name, seconds, error)
                raise ModelUnavailableError(f"failed to load model '{name}': {error}")
            self._admit(name, seconds)

    async def _victims(self, name: str, need: Footprint) -> list[str]:
        """The residents to evict for `name`, after waiting up to `patience_s` for busy ones to go idle when
        a colder one is busy or the room is held by busy models."""
        self.residency.check_fits_alone(name, need)  # no wait helps a model larger than the budget
        give_up = time.monotonic() + self.patience_s
        while True:
            self._released.clear()
            try:
                victims = self.residency.plan(name, need, self.idle)
            except ResourceExhaustedError:
                if time.monotonic() >= give_up:
                    raise
            else:
                if time.monotonic() >= give_up or not self.residency.colder_busy(victims, self.idle):
                    return victims
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._released.wait(), max(0.0, give_up - time.monotonic()))

    def _admit(self, name: str, seconds: float) -> None:
        footprint = self.registry.footprint(name)
        configs = [mv.config for mv in self.registry.all_versions(name) if mv.ready]
        self.residency.admit(name, footprint, configs[0] if configs else None)
        self._sizes[name] = footprint
        self.counts.loads[name] += 1
        log.info("model '%s' loaded on demand in %.2f s (first request waiting): %s; model memory in use %s", name,
                 seconds, footprint.shown(), self.in_use())
        try:
            self.residency.check_fits_alone(name, footprint)
        except ResourceExhaustedError as exc:
            log.warning("%s (measured after its load: it stays until it is idle)", exc.message)
        trim = asyncio.get_running_loop().create_task(self._trim_excess(name))
        self._trims.add(trim)
        trim.add_done_callback(self._trims.discard)

    async def _trim_excess(self, name: str) -> None:
        async with self._turns.turn(float("inf")):  # before any further load: it plans on what this one took
            for victim in self.residency.excess(name, self.idle):
                await self._evict(victim, OVER_BUDGET, f"model '{name}' measured {self.registry.footprint(name).shown()}, "
                                                       "more than expected: back under the budget")

    async def _evict(self, name: str, why: str, because: str) -> None:
        gone = self.residency.evict(name)
        await self.registry.evict(name, f"evicted {because}; loads again on its next request")
        self.counts.evictions[(name, why)] += 1
        log.info("model '%s' evicted (%s, least recently used and idle) %s: freed %s; model memory in use %s", name, why,
                 because, gone.footprint.shown() if gone else "nothing", self.in_use())

    def _expected(self, name: str) -> Footprint:
        """The load's size before it happens: declared, else as last measured, else its files' size on disk."""
        configs = [mv.config for mv in self.registry.all_versions(name) if mv.config is not None]
        for config in configs:
            found = declared(config, name)
            if found is not None:
                return Footprint({p: n * len(configs) for p, n in found.bytes_by_place.items()}, declared=True)
        if name in self._sizes:
            return self._sizes[name]
        return Footprint({HOST: _files_size(self.registry.root / name)})

    def in_use(self) -> str:
        return ", ".join(f"{place} {shown_size(self.residency.used(place))} of {shown_size(limit)}"
                         for place, limit in sorted(self.residency.budget.items())) or "no budget"


class LoadTurns:
    """One load (or trim) at a time. Of those waiting, the highest `heat` goes next, then the earliest;
    but one that has waited `starve_s` goes before any that has not (the earliest of them first), so a
    steady stream of hot loads cannot starve a cold model's (its requests wait within their deadlines,
    never failed for being cold). The bound is time, not turns: an earlier rule that let a load be
    passed over only twice made the line first-come-first-served as soon as it was a few deep, and under
    bench/many_models.py's Zipf load (about 20 waiting) a hot model's load waited 314 ms at the median
    for its turn, as long as a tail model's."""

    def __init__(self, starve_s: float = STARVE_S, clock=time.monotonic):
        self.starve_s, self._clock = starve_s, clock
        self._busy = False
        self._waiting: list[_Waiter] = []  # in arrival order
        self._arrivals = itertools.count()

    @contextlib.asynccontextmanager
    async def turn(self, heat: float):
        if self._busy:
            future = asyncio.get_running_loop().create_future()
            self._waiting.append(_Waiter(heat, next(self._arrivals), self._clock(), future))
            try:
                await future  # resolved by the turn before: `_busy` stays set, handed over
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    self._next()  # handed the turn just as it was cancelled: pass it on
                raise
        self._busy = True
        try:
            yield
        finally:
            self._next()

    def _next(self) -> None:
        self._waiting = [w for w in self._waiting if not w.future.done()]  # cancelled waiters leave
        if not self._waiting:
            self._busy = False
            return
        starved = self._clock() - self.starve_s
        due = [w for w in self._waiting if w.since <= starved]
        chosen = due[0] if due else max(self._waiting, key=lambda w: (w.heat, -w.arrival))
        self._waiting.remove(chosen)
        chosen.future.set_result(None)


@dataclass(slots=True)
class _Waiter:
    heat: float
    arrival: int
    since: float  # when it began to wait (LoadTurns' clock)
    future: asyncio.Future


def _files_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _consume(task: asyncio.Task) -> None:
    """A load nobody waits for any more (every waiter's deadline passed) must not log 'exception never retrieved'."""
    if not task.cancelled():
        task.exception()

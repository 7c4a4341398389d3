"""Which models are resident under the memory budget, and which to evict for the next one.

Pure bookkeeping, no loading: the registry asks `plan` before a load (which idle models to unload so
the newcomer fits), then reports what the load really took (`admit`) and what it unloaded (`evict`).
Order is least requested first: each model's requests counted with a decay (`touch` on every
request adds one, and the count halves every HALF_LIFE requests to the whole server), then its last
request, so a model nobody asks for any more fades out and one that got a single request lately (a
one-off in the long tail) leaves before one that is requested again and again. Recency alone was not
enough: with plain LRU a burst of distinct tail models pushed the hot ones out, and ranked by the
second-to-last request (LRU-2) the hot models were still evicted as often as the tail under a Zipf
load, since two requests are a noisy estimate of a rate and the tail's steadier models look as hot as
the tenth-hottest for a moment (bench/many_models.py: about 20 evictions each of models 3-9 in 20 s).
A config's `eviction_priority` parameter (higher stays longer) comes before the count, and
`pinned: "true"` models never leave.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from protos import model_config_pb2 as mc
from server.errors import ResourceExhaustedError
from server.repository.footprint import HOST, Footprint, parse_places, shown_size


HALF_LIFE = 2_000  # requests to the server over which a model's request count halves


def parse_budget(values: list[str]) -> dict[str, int]:
    """`--model-memory-budget` values ('2GiB' is host memory; 'cuda:0=30GiB' a device's) -> {place: bytes}."""
    budget: dict[str, int] = {}
    for value in values:
        budget.update(parse_places(value))
    return budget


def pinned(config: mc.ModelConfig | None) -> bool:
    if config is None or "pinned" not in config.parameters:
        return False
    return config.parameters["pinned"].string_value.strip().lower() in ("true", "1", "yes")


def eviction_priority(config: mc.ModelConfig | None) -> int:
    if config is None or "eviction_priority" not in config.parameters:
        return 0
    try:
        return int(config.parameters["eviction_priority"].string_value)
    except ValueError:
        return 0


@dataclass(slots=True)
class Resident:
    footprint: Footprint
    pinned: bool = False
    priority: int = 0


@dataclass(slots=True)
class Residency:
    budget: dict[str, int]  # place -> bytes; a place not named has no bound
    resident: OrderedDict[str, Resident] = field(default_factory=OrderedDict)  # least recently used first
    uses: dict[str, tuple[float, int]] = field(default_factory=dict)  # model -> (decayed count at its last request, that tick)
    _now: int = -1  # the latest request's tick (requests to the server, counted from 0)

    def used(self, place: str = HOST) -> int:
        return sum(r.footprint.bytes_by_place.get(place, 0) for r in self.resident.values())

    def touch(self, name: str) -> None:
        """A request for `name`: its history is kept whether it is resident or not (its next load will use it)."""
        self._now += 1
        self.uses[name] = (self._count(name, self._now) + 1.0, self._now)
        if name in self.resident:
            self.resident.move_to_end(name)

    def heat(self, name: str) -> float:
        """`name`'s decayed request count now (0 for a model never requested)."""
        return self._count(name, self._now)

    def check_fits_alone(self, name: str, need: Footprint) -> None:
        """A model that would pass the budget with nothing else resident is refused, naming both sizes."""
        for place, limit in self.budget.items():
            size = need.bytes_by_place.get(place, 0)
            if size > limit:
                raise ResourceExhaustedError(
                    f"model '{name}' needs {shown_size(size)} of {place} memory ({need.shown()}) but the model memory budget "
                    f"is {shown_size(limit)} (--model-memory-budget): it cannot be loaded even with every other model unloaded")

    def plan(self, name: str, need: Footprint, idle: Callable[[str], bool]) -> list[str]:
        """The models to evict, in order, so that `need` fits beside the rest; raises when even evicting
        every idle, unpinned model would not make room."""
        self.check_fits_alone(name, need)
        over = self._over(need)
        if not over:
            return []
        rank = self._ranks()
        candidates = sorted((n for n, r in self.resident.items() if n != name and not r.pinned and idle(n)), key=rank.get)
        victims = []
        for victim in candidates:
            if not over:
                break
            victims.append(victim)
            over = self._over(need, set(victims))
        if over:
            place = next(iter(over))
            raise ResourceExhaustedError(
                f"model '{name}' needs {shown_size(need.bytes_by_place.get(place, 0))} of {place} memory but only "
                f"{shown_size(self.budget[place] - self._used_without(place, set(victims)))} of the "
                f"{shown_size(self.budget[place])} model memory budget can be freed: the rest is held by pinned models "
                "or models with requests queued or executing; retry when they are idle")
        return victims

    def colder_busy(self, victims: list[str], idle: Callable[[str], bool]) -> list[str]:
        """Busy residents that rank colder than the hottest of `victims`: were they idle, they would leave
        first. Under a Zipf load the model loaded a moment ago for a one-off request is often still serving
        it when the next cold load plans, and then a hot model would go in its place (bench/many_models.py)."""
        if not victims:
            return []
        rank = self._ranks()
        hottest = max(rank[v] for v in victims)
        return [n for n, r in self.resident.items() if not r.pinned and not idle(n) and rank[n] < hottest]

    def excess(self, keep: str, idle: Callable[[str], bool]) -> list[str]:
        """After a load measured larger than planned: idle models to evict to come back under the budget."""
        try:
            return self.plan(keep, Footprint(), lambda n: n != keep and idle(n))
        except ResourceExhaustedError:
            return []  # nothing more can leave now; the next load tries again

    def admit(self, name: str, footprint: Footprint, config: mc.ModelConfig | None) -> None:
        self.resident[name] = Resident(footprint, pinned(config), eviction_priority(config))
        self.resident.move_to_end(name)

    def evict(self, name: str) -> Resident | None:
        return self.resident.pop(name, None)

    def _count(self, name: str, now: int) -> float:
        """`name`'s requests, each weighing half as much every HALF_LIFE requests since it came."""
        count, last = self.uses.get(name, (0.0, now))
        return count * math.exp2((last - now) / HALF_LIFE)

    def _ranks(self) -> dict[str, tuple]:
        """Each resident's place in the eviction order (smallest leaves first): eviction priority, then the
        decayed request count, then the last request, then residence order."""
        now = self._now
        return {n: (r.priority, self._count(n, now), self.uses.get(n, (0.0, -1))[1], i)
                for i, (n, r) in enumerate(self.resident.items())}

    def _used_without(self, place: str, leaving: set[str]) -> int:
        return sum(r.footprint.bytes_by_place.get(place, 0) for n, r in self.resident.items() if n not in leaving)

    def _over(self, need: Footprint, leaving: frozenset[str] | set[str] = frozenset()) -> dict[str, int]:
        """Places where `need` beside the residents (but those leaving) passes the budget -> by how much."""
        over = {}
        for place, limit in self.budget.items():
            total = self._used_without(place, leaving) + need.bytes_by_place.get(place, 0)
            if total > limit:
                over[place] = total - limit
        return over

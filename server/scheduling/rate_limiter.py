"""Triton's rate limiter: an instance runs a batch only while the resources its instance group declares
are free (`instance_group { rate_limiter { resources [...] priority } }`, `--rate-limit execution_count`).

Resources are counted per device (`cuda:N`, or `cpu`) unless declared `global`. How many of each exist
comes from `--rate-limit-resource NAME:COUNT[:DEVICE]`, else (as in Triton) from the largest count any
loaded instance asks for. Instances whose resources are taken wait in line; a release hands the freed
resources to the waiting instances in order of their group's priority (lower first, then arrival),
reserving them before the instance's runner takes its turn, so a runner whose own instance just
finished cannot take them back from a waiting one.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable


GLOBAL = "global"
Key = tuple[str, str]  # (resource name, device: 'cpu', 'cuda:N' or GLOBAL)


@dataclass(frozen=True, slots=True)
class Need:
    """What one instance holds while it runs a batch, and its group's priority."""

    counts: tuple[tuple[Key, int], ...] = ()
    priority: int = 0


def parse_resource(text: str) -> tuple[Key | tuple[str, None], int]:
    """'NAME:COUNT' (every device) or 'NAME:COUNT:DEVICE' (DEVICE a GPU index, or 'global') -> (key, count)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1].isdigit():
        raise ValueError(f"{text!r} is not NAME:COUNT or NAME:COUNT:DEVICE (e.g. R1:2, R1:1:0)")
    device = None if len(parts) == 2 else GLOBAL if parts[2] == GLOBAL else f"cuda:{int(parts[2])}" if parts[2].isdigit() else None
    if len(parts) == 3 and device is None:
        raise ValueError(f"{text!r}: DEVICE must be a GPU index or 'global'")
    return (parts[0], device), int(parts[1])


@dataclass(slots=True)
class _Waiter:
    order: tuple[int, int]
    need: Need
    granted: Callable[[], None]  # the resources are reserved for it now: its runner takes a turn


@dataclass(slots=True)
class RateLimiter:
    given: dict[tuple[str, str | None], int] = field(default_factory=dict)  # --rate-limit-resource (device None: each)
    _largest: Counter[Key] = field(default_factory=Counter)  # the largest count a loaded instance asks for
    _in_use: Counter[Key] = field(default_factory=Counter)
    _waiting: dict[object, _Waiter] = field(default_factory=dict)
    _arrivals: itertools.count = field(default_factory=itertools.count)

    def register(self, needs: list[Need]) -> None:
        """A loaded model's instances: resources nobody counted on the command line get their largest ask."""
        for need in needs:
            for key, count in need.counts:
                self._largest[key] = max(self._largest[key], count)

    def capacity(self, key: Key) -> int:
        name, device = key
        for given in ((name, device), (name, None)):
            if given in self.given:
                return self.given[given]
        return self._largest[key]

    def try_acquire(self, need: Need) -> bool:
        if not self._fits(need):
            return False
        for key, count in need.counts:
            self._in_use[key] += count
        return True

    def release(self, need: Need) -> None:
        """Give back what an instance held, and reserve it for the waiting instances it now fits, best first."""
        for key, count in need.counts:
            self._in_use[key] -= count
        for token, waiter in sorted(self._waiting.items(), key=lambda item: item[1].order):
            if self._fits(waiter.need):
                del self._waiting[token]
                self.try_acquire(waiter.need)
                waiter.granted()

    def wait(self, token: object, need: Need, granted: Callable[[], None]) -> None:
        """`token` (an instance) waits for `need`; `granted` is called once it is reserved for it. Waiting twice
        keeps the first place in line."""
        if token not in self._waiting:
            self._waiting[token] = _Waiter((need.priority, next(self._arrivals)), need, granted)

    def forget(self, token: object) -> None:
        self._waiting.pop(token, None)

    def in_use(self, name: str) -> int:
        return sum(n for (resource, _), n in self._in_use.items() if resource == name)

    def _fits(self, need: Need) -> bool:
        return all(self._in_use[key] + count <= self.capacity(key) for key, count in need.counts)

"""Triton's rate limiter: an instance runs a batch only while the resources its instance group declares
are free (`instance_group { rate_limiter { resources [...] priority } }`, `--rate-limit execution_count`).

Resources are counted per device (`cuda:N`, or `cpu`) unless declared `global`. How many of each exist
comes from `--rate-limit-resource NAME:COUNT[:DEVICE]`, else (as in Triton) from the largest count any
loaded instance asks for. Instances whose resources are taken wait in line; a release hands the freed
resources to the waiting instances in order of their group's priority (lower first, then arrival),
reserving them before the instance's runner takes its turn, so a runner whose own instance just
finished cannot take them back from a waiting one.

Priority alone orders only who is waiting at a release, and a better-priority model served by closed-loop
clients is never waiting then: its batch just answered them, and their next requests reach it a
millisecond or two later, by when a flooded model's batch holds the resources for a whole execution
(bench/rate_limiter.py: the quiet model's p99 went from 44 ms alone to 98 ms beside a flood, one flood
batch more). So the limiter anticipates, as an anticipatory disk scheduler does: an instance that has
come back quickly after its releases (mean gap under half of `anticipate_ns`) keeps its resources for up
to twice that gap, against waiters of worse priority only. It costs the flood at most that idle time
per better-priority batch, and nothing when the better one stops coming back (its gaps grow, the hold
stops).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable


GLOBAL = "global"
Key = tuple[str, str]  # (resource name, device: 'cpu', 'cuda:N' or GLOBAL)
ANTICIPATE_NS = 4_000_000  # the longest released resources wait for their better-priority instance to ask again
SEEN = 3  # return gaps measured before an instance is anticipated


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
class _Returns:
    """How soon an instance asks for its resources again after giving them back."""

    released_ns: int | None = None  # its last release not yet followed by an ask
    gap_ns: float = 0.0  # moving mean of its return gaps, each counted at most `anticipate_ns`
    seen: int = 0


@dataclass(slots=True)
class _Hold:
    need: Need
    until_ns: int
    timer: object = None


@dataclass(slots=True)
class RateLimiter:
    given: dict[tuple[str, str | None], int] = field(default_factory=dict)  # --rate-limit-resource (device None: each)
    anticipate_ns: int = ANTICIPATE_NS  # 0: never hold released resources for their instance
    clock: Callable[[], int] = time.monotonic_ns
    call_later: Callable[[float, Callable[[], None]], object] | None = None  # None: the running loop's
    _largest: Counter[Key] = field(default_factory=Counter)  # the largest count a loaded instance asks for
    _in_use: Counter[Key] = field(default_factory=Counter)
    _waiting: dict[object, _Waiter] = field(default_factory=dict)
    _arrivals: itertools.count = field(default_factory=itertools.count)
    _returns: dict[object, _Returns] = field(default_factory=dict)
    _holds: dict[object, _Hold] = field(default_factory=dict)  # token -> resources kept for it a moment
    anticipated: int = 0  # holds begun, and of them taken back by their instance in time (for tests and metrics)
    anticipated_taken: int = 0

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

    def try_acquire(self, need: Need, token: object = None) -> bool:
        """Take `need` for `token` (an instance) if it is free; resources held for a better instance are
        not free to a worse one."""
        self._asked(token)
        hold = self._holds.pop(token, None)
        if hold is not None:
            self._cancel(hold)
            self.anticipated_taken += 1
        if not self._fits(need, need.priority):
            if hold is not None:
                self._grant()  # what was held for it goes to the others in line
            return False
        self._take(need)
        return True

    def release(self, need: Need, token: object = None) -> None:
        """Give back what an instance held: kept a moment for it where it comes back quickly and worse
        instances wait, else reserved for the waiting instances it now fits, best first."""
        for key, count in need.counts:
            self._in_use[key] -= count
        if token is not None:
            self._hold_for(token, need)
        self._grant()

    def wait(self, token: object, need: Need, granted: Callable[[], None]) -> None:
        """`token` (an instance) waits for `need`; `granted` is called once it is reserved for it. Waiting twice
        keeps the first place in line."""
        self._asked(token)
        if token not in self._waiting:
            self._waiting[token] = _Waiter((need.priority, next(self._arrivals)), need, granted)

    def forget(self, token: object) -> None:
        self._waiting.pop(token, None)
        self._returns.pop(token, None)
        hold = self._holds.pop(token, None)
        if hold is not None:
            self._cancel(hold)
            self._grant()

    def in_use(self, name: str) -> int:
        return sum(n for (resource, _), n in self._in_use.items() if resource == name)

    def _take(self, need: Need) -> None:
        for key, count in need.counts:
            self._in_use[key] += count

    def _grant(self) -> None:
        for token, waiter in sorted(self._waiting.items(), key=lambda item: item[1].order):
            if self._fits(waiter.need, waiter.need.priority):
                del self._waiting[token]
                self._take(waiter.need)
                waiter.granted()

    def _asked(self, token: object) -> None:
        """The first ask after a release measures how soon `token` came back."""
        returns = self._returns.get(token)
        if returns is None or returns.released_ns is None:
            return
        gap = min(self.clock() - returns.released_ns, self.anticipate_ns)
        returns.gap_ns = gap if not returns.seen else 0.75 * returns.gap_ns + 0.25 * gap
        returns.seen += 1
        returns.released_ns = None

    def _hold_for(self, token: object, need: Need) -> None:
        returns = self._returns.setdefault(token, _Returns())
        now = self.clock()
        returns.released_ns = now
        if (not self.anticipate_ns or returns.seen < SEEN or returns.gap_ns * 2 > self.anticipate_ns
                or not any(w.need.priority > need.priority and _shares(w.need, need) for w in self._waiting.values())):
            return
        hold_ns = int(min(self.anticipate_ns, 2 * returns.gap_ns))
        hold = self._holds[token] = _Hold(need, now + hold_ns)
        self.anticipated += 1
        call_later = self.call_later or asyncio.get_running_loop().call_later
        hold.timer = call_later(hold_ns / 1e9, lambda: self._expire(token, hold))

    def _expire(self, token: object, hold: _Hold) -> None:
        if self._holds.get(token) is hold:
            del self._holds[token]
            self._grant()

    @staticmethod
    def _cancel(hold: _Hold) -> None:
        if hold.timer is not None and hasattr(hold.timer, "cancel"):
            hold.timer.cancel()

    def _fits(self, need: Need, priority: int) -> bool:
        """Whether `need` fits beside what is in use and what is held for instances of better priority."""
        held: Counter[Key] = Counter()
        for hold in self._holds.values():
            if hold.need.priority < priority:
                for key, count in hold.need.counts:
                    held[key] += count
        return all(self._in_use[key] + held[key] + count <= self.capacity(key) for key, count in need.counts)


def _shares(a: Need, b: Need) -> bool:
    keys = {key for key, _ in b.counts}
    return any(key in keys for key, _ in a.counts)

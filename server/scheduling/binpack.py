"""Cost-aware batching: requests of similar cost share a batch, so padding and waiting stay bounded.

NOTE (the invariant). A batch never mixes cost buckets, and its padded cost (rows x the largest row
cost) stays within `max_batch_cost` unless a single request alone exceeds it. The one exception is asked for
by `min_batch_cost`: a batch cut under that padded cost takes in the oldest requests of the buckets above
(nearest bucket first, higher priority levels first, as a bucket's own batch fills) while its padded cost stays under it, because a forward
has a fixed cost that a few short rows cannot carry (an encoder on a CPU runs 40 tokens at twice the cost a
token of 300); padding a handful of short rows up to the next bucket's length is cheaper than a second
forward. Everything else is the
dynamic batcher's (this class extends it): admission, priority levels, queue policies, deadlines,
windows and "cut only when an instance is free". Each request waits in the group (join key, bucket)
it was admitted to; boundaries that move later do not move it, they only shift slowly and the budget
still bounds the padding. Which group runs next: the highest priority level first (as the dynamic
batcher), then the group whose head is due first. A head is due at its deadline, or after waiting
`stretch` times its bucket's measured batch time if that comes first: short requests overtake long
ones only while the long ones have slack, so a stream of short requests cannot starve a long one.
Boundaries come from the config or are fitted to the last `learning_window` costs (fit_boundaries).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Sequence

from server.request import Batch, InferRequest
from server.scheduling.base import Gauges
from server.scheduling.dynamic import BatchingSettings, DynamicBatcher
from server.scheduling.queue import Group, RequestQueue

_GRID = 32  # candidate cut points when fitting boundaries: this many quantiles of the recent costs
_ALPHA = 0.2  # weight of the newest batch time in each bucket's moving average


@dataclass(frozen=True, slots=True)
class BinPackSettings:
    quadratic: bool = False  # a row costs length^2 (attention) instead of length
    boundaries: tuple[float, ...] = ()  # upper cost bounds of every bucket but the last; (): learned
    num_buckets: int = 4  # learned boundaries: at most this many buckets
    learning_window: int = 1024  # learned boundaries: recent costs they are fitted to
    max_batch_cost: float = 0.0  # budget on rows x largest row cost; 0: none
    stretch: float = 4.0  # a request is due after waiting this many of its bucket's batch times
    min_batch_cost: float = 0.0  # a batch cheaper than this takes in the next buckets' heads; 0: never

    def row_cost(self, length: int) -> float:
        length = max(length, 1)  # models without a variable length: every row costs the same
        return float(length * length if self.quadratic else length)


def fit_boundaries(costs: Sequence[float], buckets: int) -> tuple[float, ...]:
    """Upper bounds of at most `buckets` buckets that leave these costs the least padding.

    Padding of a bucket = sum over its members of (largest cost - own cost). Cuts are chosen among
    quantiles of the costs (never between equal costs) by dynamic programming over those candidates.
    """
    s = sorted(costs)
    n = len(s)
    if n == 0 or buckets <= 1:
        return ()
    prefix = list(itertools.accumulate(s, initial=0.0))
    # candidate bucket ends: the last index of each quantile's run of equal costs
    ends = sorted({bisect.bisect_right(s, s[q * n // _GRID]) - 1 for q in range(1, _GRID)} | {n - 1})

    def waste(first: int, last: int) -> float:
        return (last - first + 1) * s[last] - (prefix[last + 1] - prefix[first])

    best = [waste(0, e) for e in ends]  # best[j]: least padding covering s[0..ends[j]]
    cuts: list[tuple[int, ...]] = [() for _ in ends]
    for _ in range(buckets - 1):
        new_best, new_cuts = list(best), list(cuts)
        for j, end in enumerate(ends):
            for i in range(j):
                total = best[i] + waste(ends[i] + 1, end)
                if total < new_best[j]:
                    new_best[j], new_cuts[j] = total, cuts[i] + (i,)
        best, cuts = new_best, new_cuts
    return tuple(s[ends[i]] for i in cuts[-1])


class CostBuckets:
    """Bucket boundaries: fixed by the config, or refitted to the recent costs as traffic shifts."""

    def __init__(self, fixed: tuple[float, ...], count: int, window: int):
        self.boundaries = tuple(fixed)
        self._learn = not fixed
        self._count = count
        self._recent: deque[float] = deque(maxlen=window)
        self._every = max(window // 8, 1)
        self._since = 0

    def bucket(self, cost: float) -> int:
        """Bucket i holds costs <= boundaries[i]; the last one everything above."""
        return bisect.bisect_left(self.boundaries, cost)

    def observe(self, cost: float) -> None:
        if not self._learn:
            return
        self._recent.append(cost)
        self._since += 1
        # refit after 1, 2, 4, 8, ... arrivals while the window fills, then every window / 8
        if self._since >= min(max(len(self._recent) // 2, 1), self._every):
            self.boundaries = fit_boundaries(self._recent, self._count)
            self._since = 0


class BinPackBatcher(DynamicBatcher):
    def __init__(self, settings: BatchingSettings, binpack: BinPackSettings, queue: RequestQueue):
        super().__init__(replace(settings, join=True), queue)
        self.binpack = binpack
        self.costs = CostBuckets(binpack.boundaries, binpack.num_buckets, binpack.learning_window)
        self._batch_ns: dict[int, float] = {}  # moving average of batch time per bucket

    def submit(self, request: InferRequest, now_ns: int) -> bool:
        super().submit(request, now_ns)
        self.costs.observe(self._cost(request))
        return True  # its groups fill by cost too, and their order moves: every arrival gets a turn

    def complete(self, batch: Batch, exec_ns: int | None, now_ns: int) -> None:
        super().complete(batch, exec_ns, now_ns)
        if exec_ns is not None and batch.bucket is not None:
            old = self._batch_ns.get(batch.bucket)
            self._batch_ns[batch.bucket] = exec_ns if old is None else old + _ALPHA * (exec_ns - old)

    def gauges(self) -> Gauges:
        return replace(super().gauges(), buckets=self._bucket_depths())

    def _bucket_depths(self) -> list[tuple[float, int]]:
        bounds = self.costs.boundaries
        depth = [0] * (len(bounds) + 1)
        for group in self.queue.groups():
            bucket = group.key[1]
            depth += [0] * (bucket + 1 - len(depth))  # admitted under boundaries since refitted
            depth[bucket] += len(group)
        return [(bounds[i] if i < len(bounds) else math.inf, d) for i, d in enumerate(depth)]

    def _cost(self, request: InferRequest) -> float:
        return request.cost or self.binpack.row_cost(request.length)

    def _group_key(self, request: InferRequest) -> tuple:
        return (request.batch_key, self.costs.bucket(self._cost(request)))

    def _ranked(self, now_ns: int) -> list[Group]:
        return sorted(self.queue.groups(), key=self._urgency)

    def _urgency(self, group: Group) -> tuple:
        head = group.head()
        due = head.enqueue_ns + self.binpack.stretch * self._batch_ns.get(group.key[1], 0.0)
        if head.deadline_ns is not None:
            due = min(due, head.deadline_ns)
        return head.lane, due, head.sequence

    def _batch(self, group: Group, requests: list[InferRequest], batched: bool) -> Batch:
        if batched and self.binpack.min_batch_cost:
            requests = self._topped_up(group, requests)
        return Batch(requests, batched, bucket=group.key[1])

    def _topped_up(self, group: Group, requests: list[InferRequest]) -> list[InferRequest]:
        """The cut batch plus the heads of the buckets above while its padded cost stays under
        `min_batch_cost` (and `max_batch_size`, `max_batch_cost`): see NOTE."""
        floor, budget, limit = self.binpack.min_batch_cost, self.binpack.max_batch_cost, self.settings.max_batch_size
        rows = sum(r.batch_size for r in requests)
        top = max(self._cost(r) for r in requests)
        if rows * top >= floor:
            return requests
        key, bucket = group.key
        above = sorted((g for g in self.queue.groups() if g.key[0] == key and g.key[1] > bucket and len(g)),
                       key=lambda g: g.key[1])
        for other in above:
            count = 0
            for request in other:
                grown, cost = rows + request.batch_size, max(top, self._cost(request))
                if grown > limit or grown * cost > floor or (budget and grown * cost > budget):
                    break
                rows, top, count = grown, cost, count + 1
            if count:
                self._executing += count
                requests = requests + self.queue.take(other, count)
            if count < len(other):
                break  # the next request up did not fit: those of higher buckets cost more still
        return requests

    def _fill(self, group: Group) -> tuple[int, int, bool]:
        limit, budget = self.settings.max_batch_size, self.binpack.max_batch_cost
        rows = count = 0
        top = 0.0  # largest row cost so far: every row is padded to it
        for request in group:
            grown, cost = rows + request.batch_size, max(top, self._cost(request))
            if grown > limit or (budget and count and grown * cost > budget):
                return count, rows, True
            rows, count, top = grown, count + 1, cost
        return count, rows, rows == limit or bool(budget and (rows + 1) * top > budget)

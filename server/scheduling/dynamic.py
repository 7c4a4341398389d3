"""Dynamic batching: a batch leaves when it is full or when its oldest request has waited long enough.

NOTE: a batch is only cut when an instance is free to run it (the runner calls `next_batch` then),
so while every instance is busy the queue keeps growing into larger batches. Cut rule, per group of
joinable requests, most urgent group first: dispatch at once if the group fills `max_batch_size`
or reaches a preferred size (the largest one it can fill); otherwise wait until the group's window
closes (a fixed `max_queue_delay`, or the adaptive window of adaptive.py), then dispatch what is there.

NOTE (what an arrival costs). The window is decided when it opens (the first turn that sees the group's
head), again each time the group has grown by half since (what is still expected shrinks as rows come) and
once the decided close has come (an adaptive window may run on): a few times per batch, never per
arrival. Between decisions an arrival only checks what can end the window early (a full batch, a
preferred size, nobody else expected or the stream paused) and `submit` says whether anything did. An
arrival that changes nothing needs no turn of the runner, and the runner's timer, set for the decided
close, stays as it is.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from server.request import Batch, InferRequest
from server.scheduling.adaptive import AdaptiveWindow, FixedWindow
from server.scheduling.base import Gauges, Scheduler
from server.scheduling.queue import Group, RequestQueue

_REDECIDE_GROWTH = 1.5  # the window is decided again once the group has grown by half since the last decision


@dataclass(frozen=True, slots=True)
class BatchingSettings:
    max_batch_size: int  # rows per batch; 0: the model does not batch, requests run one by one
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_ns: int = 0
    join: bool = True  # False: Triton's default scheduler, each request is its own batch
    latency_target_ns: int = 0  # > 0: adaptive window holding this queue + compute budget


class DynamicBatcher(Scheduler):
    def __init__(self, settings: BatchingSettings, queue: RequestQueue):
        self.settings = settings
        self.queue = queue
        self._preferred = frozenset(settings.preferred_batch_sizes)
        self._executing = 0  # requests dispatched and not yet completed
        if settings.latency_target_ns:
            self.window = AdaptiveWindow(settings.latency_target_ns, settings.max_batch_size)
            self._redecide_growth = _REDECIDE_GROWTH
        else:
            self.window = FixedWindow(settings.max_queue_delay_ns)
            self._redecide_growth = math.inf  # a fixed window's close does not depend on the rows

    def __len__(self) -> int:
        return len(self.queue)

    def submit(self, request: InferRequest, now_ns: int) -> bool:
        group = self.queue.push(request, now_ns, self._group_key(request))
        self.window.on_arrival(now_ns, self._in_system)
        return self._arrival_matters(group, now_ns)

    def _arrival_matters(self, group: Group, now_ns: int) -> bool:
        """False when the arrival leaves the group waiting for a window already decided (and the runner's
        timer set for it): not full, no preferred size reached, more rows still expected."""
        settings = self.settings
        if not settings.join or self._preferred or group.decided_head is not group.head() or self.queue.group_count != 1:
            return True
        rows = group.rows
        return (rows >= settings.max_batch_size or now_ns >= group.close_ns or rows >= self._redecide_growth * group.decided_rows
                or not self.window.still_expecting(rows, self._in_system, now_ns))

    def complete(self, batch: Batch, exec_ns: int | None, now_ns: int) -> None:
        self._executing -= len(batch.requests)
        if exec_ns is not None:
            self.window.on_batch(batch.size, exec_ns)

    def observe_frontend(self, busy_ratio: float | None) -> None:
        self.window.on_frontend(busy_ratio)

    @property
    def _in_system(self) -> int:
        return len(self.queue) + self._executing

    def gauges(self) -> Gauges:
        return Gauges(pending=len(self), window_ns=self.window.current_ns)

    def cancel(self, request: InferRequest) -> bool:
        return self.queue.remove(request)

    def expire(self, now_ns: int) -> list[InferRequest]:
        return self.queue.expire(now_ns)

    def next_batch(self, now_ns: int) -> Batch | None:
        batching = self.settings.max_batch_size > 0
        for group in self._ranked(now_ns):
            count = self._cut(group, now_ns) if batching and self.settings.join else 1
            if count:
                self._executing += count
                return self._batch(group, self.queue.take(group, count), batching)
        return None

    def next_event_ns(self, now_ns: int) -> int | None:
        # Windows already over are waiting for an instance, whose release wakes the runner anyway.
        times = []
        if self.settings.join and self.settings.max_batch_size > 0:
            for group in self.queue.groups():
                rows = self._fill(group)[1]
                close = self._close_ns(group, rows, now_ns)
                if close > now_ns:
                    pause = self.window.pause_ns(rows)
                    times.append(close if pause is None or pause <= now_ns else min(close, pause))
        deadline = self.queue.next_deadline_ns()
        if deadline is not None:
            times.append(deadline)
        return min(times) if times else None

    # Hooks a finer policy (binpack.py) overrides; the rest of the batcher is shared.
    def _group_key(self, request: InferRequest) -> tuple | None:
        """The queue group a request waits in (None: its join key)."""
        return None

    def _ranked(self, now_ns: int) -> list[Group]:
        """Groups in the order they are offered an instance: highest priority, then oldest head."""
        return self.queue.groups()

    def _batch(self, group: Group, requests: list[InferRequest], batched: bool) -> Batch:
        return Batch(requests, batched)

    def _fill(self, group: Group) -> tuple[int, int, bool]:
        """(requests, rows) of the next batch the group can make, and whether that batch is full."""
        limit = self.settings.max_batch_size
        if group.rows <= limit:  # all of it fits (the usual case): no walk over the queue
            return len(group), group.rows, group.rows == limit
        rows = count = 0
        for request in group:
            if rows + request.batch_size > limit:
                return count, rows, True
            rows += request.batch_size
            count += 1
        return count, rows, rows == limit

    def _cut(self, group: Group, now_ns: int) -> int:
        """How many requests of the group to dispatch now (0: keep waiting)."""
        count, rows, full = self._fill(group)
        if full:
            return count
        if self._preferred:
            preferred = prefix = 0
            for i, request in enumerate(itertools.islice(group, count), 1):
                prefix += request.batch_size
                if prefix in self._preferred:
                    preferred = i
            if preferred:
                return preferred
        return count if now_ns >= self._close_ns(group, rows, now_ns) else 0

    def _close_ns(self, group: Group, rows: int, now_ns: int) -> int:
        """When the group's window closes: decided anew for a new head, a group grown by half or once the decided
        close has come (see NOTE); in between, the decision stands unless nobody else is expected any more."""
        head = group.head()
        if group.decided_head is head and now_ns < group.close_ns and rows < self._redecide_growth * group.decided_rows:
            return group.close_ns if self.window.still_expecting(rows, self._in_system, now_ns) else now_ns
        close = self.window.close_ns(head.enqueue_ns, rows, now_ns, self._in_system)
        group.decided_head, group.decided_rows, group.close_ns = head, rows, close
        return close

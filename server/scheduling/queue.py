"""Admission and waiting: priority levels, per-level queue policies, deadlines.

Requests wait in lanes: one lane per (group key, priority level), so a batch can be drawn from the
requests that can actually run together without scanning the others. The group key is the join
key, or a finer one a policy passes (binpack adds the cost bucket). Level 1 is the highest
priority. A request whose deadline passes is removed (REJECT) or moved to a lane behind every level
(DELAY): it never holds a place in front of requests that can still make their deadline.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass

from server.errors import QueueFullError
from server.request import InferRequest

REJECT, DELAY = "REJECT", "DELAY"


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    timeout_action: str = REJECT
    default_timeout_us: int = 0  # 0: no default deadline
    allow_timeout_override: bool = False
    max_queue_size: int = 0  # 0: unbounded

    def deadline_ns(self, arrival_ns: int, timeout_us: int | None, rpc_deadline_ns: int | None) -> int | None:
        """Earliest of the RPC deadline, the policy's default and the request's own timeout.

        Unlike Triton, a request's `timeout` counts even when the policy sets no default; when the
        policy does set one, the request may only replace it if overriding is allowed.
        """
        if not (timeout_us or self.default_timeout_us):  # the usual case: only the RPC's deadline, if any
            return rpc_deadline_ns
        candidates = [rpc_deadline_ns] if rpc_deadline_ns is not None else []
        own = timeout_us if timeout_us else None
        if self.default_timeout_us and not (own and self.allow_timeout_override):
            own = self.default_timeout_us
        if own:
            candidates.append(arrival_ns + own * 1000)
        return min(candidates) if candidates else None


class Group:
    """Queued requests that share a join key, one FIFO lane per priority level plus a late lane."""

    __slots__ = ("key", "lanes", "rows", "decided_head", "decided_rows", "close_ns")

    def __init__(self, key: tuple, levels: int):
        self.key = key
        self.lanes = [deque() for _ in range(levels + 1)]  # last lane: DELAY requests past their deadline
        self.rows = 0  # batch rows of every request queued here, kept by the queue
        # The batcher's window decision for the current head (dynamic.py), not made per arrival: when it
        # was made, for how many rows, and when the window closes. Stale once the head is another request.
        self.decided_head: InferRequest | None = None
        self.decided_rows = self.close_ns = 0

    def head(self) -> InferRequest | None:
        for lane in self.lanes:
            if lane:
                return lane[0]
        return None

    def __iter__(self):
        return itertools.chain.from_iterable(self.lanes)

    def __len__(self) -> int:
        return sum(len(lane) for lane in self.lanes)


class RequestQueue:
    def __init__(self, policies: list[QueuePolicy], default_level: int = 1, max_total: int = 0):
        if not 1 <= default_level <= len(policies):
            raise ValueError(f"default priority level {default_level} outside 1..{len(policies)}")
        self.policies = policies
        self.default_level = default_level
        self.max_total = max_total  # server-wide backstop so memory stays bounded when policies say "unbounded"
        self._groups: dict[tuple, Group] = {}
        self._per_level = [0] * (len(policies) + 1)
        self._size = 0  # sum(self._per_level), kept: asked several times per arrival
        self._deadlines: list[tuple[int, int, InferRequest]] = []
        self._departed = 0  # heap entries whose request already left the queue
        self._sequence = itertools.count()

    def __len__(self) -> int:
        return self._size

    def level(self, priority: int | None) -> int:
        """Map a request's `priority` parameter to a level: 0 or out of range -> the default (as Triton)."""
        if not priority or not 1 <= priority <= len(self.policies):
            return self.default_level
        return int(priority)

    def policy(self, level: int) -> QueuePolicy:
        return self.policies[level - 1]

    @property
    def group_count(self) -> int:
        return len(self._groups)

    def push(self, request: InferRequest, now_ns: int, group_key: tuple | None = None) -> Group:
        """Admit a request into the group of `group_key` (default: its join key), which is returned; raises
        QueueFullError."""
        level = request.priority = self.level(request.priority)
        policy = self.policy(level)
        limit = policy.max_queue_size
        if limit and self._per_level[level - 1] >= limit:
            raise QueueFullError(
                f"model '{request.model_name}': request queue for priority level {level} is full "
                f"(max_queue_size {limit}); retry later or raise max_queue_size"
            )
        if self.max_total and len(self) >= self.max_total:
            raise QueueFullError(
                f"model '{request.model_name}': request queue is full ({self.max_total} requests pending, the "
                "server's --max-queued-requests); retry later"
            )
        key = request.group_key = request.batch_key if group_key is None else group_key
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = Group(key, len(self.policies))
        request.sequence = next(self._sequence)
        request.enqueue_ns = now_ns
        request.deadline_ns = policy.deadline_ns(request.arrival_ns or now_ns, request.timeout_us, request.deadline_ns)
        request.timeout_action = policy.timeout_action
        self._place(request, group, level - 1)
        if request.deadline_ns is not None:
            heapq.heappush(self._deadlines, (request.deadline_ns, request.sequence, request))
        return group

    def remove(self, request: InferRequest) -> bool:
        lane = request.slot
        if lane is None:
            return False
        lane.remove(request)
        group = self._groups[request.group_key]
        self._unplace(request, group)
        if group.head() is None:
            del self._groups[group.key]
        return True

    def expire(self, now_ns: int) -> list[InferRequest]:
        """Reject requests past their deadline; move DELAY ones behind every level."""
        rejected = []
        while self._deadlines and self._deadlines[0][0] <= now_ns:
            _, _, request = heapq.heappop(self._deadlines)
            if request.slot is None:
                continue  # already dispatched or cancelled
            self.remove(request)
            if request.timeout_action == DELAY:
                key = request.group_key
                group = self._groups.setdefault(key, Group(key, len(self.policies)))
                self._place(request, group, len(self.policies))
            else:
                rejected.append(request)
        return rejected

    def next_deadline_ns(self) -> int | None:
        while self._deadlines and self._deadlines[0][2].slot is None:
            heapq.heappop(self._deadlines)  # drop entries of requests that already left
        return self._deadlines[0][0] if self._deadlines else None

    def groups(self) -> list[Group]:
        """Non-empty groups, the one whose head is most urgent (highest level, then oldest) first."""
        if len(self._groups) == 1:  # the usual case (one shape, one level): nothing to rank
            (group,) = self._groups.values()
            return [group] if group.head() is not None else []
        heads = [(g.head(), g) for g in self._groups.values()]
        live = sorted(((h.lane, h.sequence), g) for h, g in heads if h is not None)
        return [g for _, g in live]

    def take(self, group: Group, count: int) -> list[InferRequest]:
        """Remove the first `count` requests of a group, in lane order."""
        taken = []
        for lane in group.lanes:
            while lane and len(taken) < count:
                request = lane.popleft()
                self._unplace(request, group)
                taken.append(request)
        if group.head() is None:
            del self._groups[group.key]
        return taken

    def _place(self, request: InferRequest, group: Group, index: int) -> None:
        lane = group.lanes[index]
        lane.append(request)
        request.slot, request.lane = lane, index
        self._per_level[index] += 1
        self._size += 1
        group.rows += request.batch_size

    def _unplace(self, request: InferRequest, group: Group) -> None:
        request.slot = None
        if group.decided_head is request:  # its window's decision goes with it (and holds no inputs alive)
            group.decided_head = None
        self._per_level[request.lane] -= 1
        self._size -= 1
        group.rows -= request.batch_size
        if request.deadline_ns is not None:
            self._departed += 1
            if self._departed > 64 and self._departed * 2 > len(self._deadlines):
                # Left requests would otherwise stay referenced (inputs and all) behind a live head.
                self._deadlines = [e for e in self._deadlines if e[2].slot is not None]
                heapq.heapify(self._deadlines)
                self._departed = 0

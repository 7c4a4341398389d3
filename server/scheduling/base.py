"""The seam every batching policy implements; the model runner drives it from one event loop."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from server.request import Batch, InferRequest


@dataclass(frozen=True, slots=True)
class Gauges:
    """What a policy shows on the metrics page, read once per loop turn: one record, whatever the policy."""

    pending: int = 0  # requests waiting
    window_ns: int = 0  # the batching window in force (0 where the policy has none)
    buckets: list[tuple[float, int]] = field(default_factory=list)  # (upper cost bound, waiting) per cost bucket


class Scheduler(ABC):
    """Decides which queued requests run together and when.

    The runner calls `submit` for each admitted request, `next_batch` whenever an instance is free,
    `expire` and `next_event_ns` to wake on time, and `complete` after each batch ran. Only the
    runner's event loop calls these, so implementations need no locks.
    """

    @abstractmethod
    def submit(self, request: InferRequest, now_ns: int) -> bool:
        """Queue a request or raise QueueFullError; never blocks. True when the arrival may let a batch be
        cut now or move the next event (the runner then takes a turn if an instance is free); False when
        it changes neither, so a turn would only find what the last one found."""

    @abstractmethod
    def next_batch(self, now_ns: int) -> Batch | None:
        """A batch for a free instance, or None when waiting longer would give a better one."""

    @abstractmethod
    def next_event_ns(self, now_ns: int) -> int | None:
        """The monotonic time at which `next_batch` or `expire` may answer differently; None: no timer needed."""

    @abstractmethod
    def expire(self, now_ns: int) -> list[InferRequest]:
        """Remove and return the requests whose deadline passed and whose policy rejects them."""

    @abstractmethod
    def cancel(self, request: InferRequest) -> bool:
        """Drop a queued request (client gone); False if it already left the queue."""

    def complete(self, batch: Batch, exec_ns: int | None, now_ns: int) -> None:
        """A dispatched batch finished (exec_ns None: it failed); adaptive policies learn from it."""

    def observe_frontend(self, busy_ratio: float | None) -> None:
        """The share of time the front end's event loop is busy (None: unknown); a policy that can
        trade latency for front-end work (the adaptive window) uses it, the others ignore it."""

    def gauges(self) -> Gauges:
        """The policy's state for the metrics page; a policy with more to show extends the record."""
        return Gauges(pending=len(self))

    @abstractmethod
    def __len__(self) -> int:
        """Requests waiting."""

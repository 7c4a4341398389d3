"""Which sequences of a stateful model are live: slots, starts, ends and idle release.

A sequence (one correlation id) holds a slot from its START request to its END request, or until it
has been idle longer than `max_sequence_idle_microseconds`; then its slot and state are released and
a later request without START is refused. `capacity` is how many sequences may be live at once
(`direct`: one per batch slot, max_batch_size x instances; `oldest`: max_candidate_sequences, 0 for
no limit). Pure: time comes in as `now`, the state carried is opaque to the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable


@dataclass(slots=True)
class LiveSequence:
    last_ns: int
    state: Any = None  # the model's implicit state after the sequence's last request


class SequenceSlots:
    def __init__(self, capacity: int, idle_ns: int):
        self.capacity = capacity  # 0: no limit
        self.idle_ns = idle_ns
        self._live: dict[Hashable, LiveSequence] = {}

    def __len__(self) -> int:
        return len(self._live)

    def begin(self, cid: Hashable, now: int) -> LiveSequence | None:
        """Start (or restart) a sequence; None when every slot is taken by another live sequence."""
        if cid not in self._live and self.capacity and len(self._live) >= self.capacity:
            return None
        self._live[cid] = LiveSequence(now)
        return self._live[cid]

    def touch(self, cid: Hashable, now: int) -> LiveSequence | None:
        """The live sequence `cid` (its idle clock restarted), or None if it is not live."""
        live = self._live.get(cid)
        if live is not None:
            live.last_ns = now
        return live

    def end(self, cid: Hashable, live: LiveSequence | None = None) -> bool:
        """End sequence `cid`; given `live`, only if that is still the sequence live under the id (not one a
        START has begun since). Whether one ended."""
        if cid not in self._live or (live is not None and self._live[cid] is not live):
            return False
        del self._live[cid]
        return True

    def expire(self, now: int, busy: set) -> list[Hashable]:
        """Release sequences idle for longer than the limit, except those with a request in flight."""
        if not self.idle_ns:
            return []
        gone = [cid for cid, live in self._live.items() if cid not in busy and now - live.last_ns > self.idle_ns]
        for cid in gone:
            del self._live[cid]
        return gone

    def next_event_ns(self) -> int | None:
        """When the next idle sequence may be released (None: nothing live or no idle limit)."""
        if not self.idle_ns or not self._live:
            return None
        return min(live.last_ns for live in self._live.values()) + self.idle_ns + 1

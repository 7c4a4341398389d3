"""The pure sequence-slot policy: capacity, restart, end, idle release (never while a request runs)."""

from server.scheduling.sequence_slots import SequenceSlots

MS = 1_000_000


def test_capacity_bounds_live_sequences_and_an_end_frees_a_slot():
    slots = SequenceSlots(capacity=2, idle_ns=0)
    assert slots.begin(1, 0) and slots.begin("a", 0)
    assert slots.begin(3, 0) is None
    assert slots.begin(1, 5) is not None  # restarting a live sequence needs no new slot
    slots.end("a")
    assert slots.begin(3, 0) is not None and len(slots) == 2


def test_idle_sequences_are_released_after_the_limit_unless_busy():
    slots = SequenceSlots(capacity=0, idle_ns=100 * MS)
    slots.begin(1, 0)
    slots.begin(2, 0)
    assert slots.next_event_ns() == 100 * MS + 1
    assert slots.expire(100 * MS, set()) == []  # exactly at the limit: still live
    slots.touch(2, 50 * MS)
    assert slots.expire(101 * MS, busy=set()) == [1]
    assert slots.expire(500 * MS, busy={2}) == [] and slots.touch(2, 500 * MS) is not None
    assert slots.touch(1, 500 * MS) is None  # released: a request without START is refused by the runner

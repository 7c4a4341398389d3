"""The pure sequence-slot policy: capacity, restart, end, idle release (never while a request runs), and the
idle limit a config gets (Triton's default when unset)."""

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


def test_ending_a_given_sequence_leaves_one_started_since_under_the_same_id():
    slots = SequenceSlots(capacity=0, idle_ns=0)
    old = slots.begin(7, 0)
    new = slots.begin(7, 1)  # a START again under the same id
    assert not slots.end(7, old) and slots.touch(7, 2) is new
    assert slots.end(7, new) and slots.touch(7, 3) is None
    assert not slots.end(7)


def test_an_unset_or_zero_idle_limit_is_tritons_one_second():
    from protos import model_config_pb2 as mc
    from server.runners.factory import idle_ns

    assert idle_ns(mc.ModelSequenceBatching()) == 1_000 * MS
    assert idle_ns(mc.ModelSequenceBatching(max_sequence_idle_microseconds=0)) == 1_000 * MS
    assert idle_ns(mc.ModelSequenceBatching(max_sequence_idle_microseconds=250_000)) == 250 * MS

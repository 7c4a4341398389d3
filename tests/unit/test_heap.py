"""Parking the startup heap outside the cycle collector, and giving it back after an unload."""

from __future__ import annotations

import gc
import weakref

from server import heap


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cycle collector can free it


def test_a_cycle_parked_at_startup_is_freed_by_reclaim_after_an_unload():
    try:
        model = Node()
        alive = weakref.ref(model)
        heap.park()
        assert gc.get_freeze_count() > 0
        del model  # "unloaded": unreachable, but parked, so an ordinary collection skips it
        gc.collect()
        assert alive() is not None
        heap.reclaim()
        assert alive() is None
        assert gc.get_freeze_count() > 0  # what survives is parked again
    finally:
        gc.unfreeze()


def test_reclaim_does_nothing_where_nothing_was_parked():
    gc.unfreeze()
    heap.reclaim()
    assert gc.get_freeze_count() == 0


def test_the_allocator_settings_apply_on_glibc():
    """Big steps' tensors reuse the heap (server/heap.py): on glibc mallopt takes both settings (it
    answers 0 for a setting it refuses); elsewhere nothing is changed."""
    import platform

    assert heap.keep() is (platform.libc_ver()[0] == "glibc")

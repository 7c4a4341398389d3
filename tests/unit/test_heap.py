"""Parking the startup heap outside the cycle collector, and giving it back after an unload."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from server import heap
from server.backends.llm import linear


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
        heap.unpark()


def test_after_startup_the_objects_of_requests_in_flight_trigger_no_collection():
    """At 64 clients ~2,600 young container objects are alive at once (server/heap.py): with the default
    threshold the collector walks them every 700 allocations; once parked, it does not run at all."""
    collections = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 0:
            collections.append(info)

    def in_flight():
        collections.clear()
        alive = [{"request": i} for i in range(2600)]  # tracked containers, as requests' dicts are
        del alive
        return len(collections)

    saved = gc.get_threshold()
    gc.callbacks.append(count)
    try:
        gc.set_threshold(700, *saved[1:])
        assert in_flight() >= 3
        heap.park()
        assert gc.get_threshold()[0] == heap.GEN0_THRESHOLD
        assert in_flight() == 0
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*saved)
        heap.unpark()


def test_reclaim_does_nothing_where_nothing_was_parked():
    heap.unpark()
    heap.reclaim()
    assert gc.get_freeze_count() == 0


def test_the_allocator_settings_apply_on_glibc():
    """Big steps' tensors reuse the heap (server/heap.py): on glibc mallopt takes both settings (it
    answers 0 for a setting it refuses); elsewhere nothing is changed."""
    import platform

    assert heap.keep() is (platform.libc_ver()[0] == "glibc")


ONEDNN_SHAPES = """
import sys
from server import heap
if sys.argv[1] == "keep":
    heap.keep()
import torch
w, b = torch.randn(64, 32), torch.randn(64)
with torch.inference_mode():
    for rows in list(range(1, 1101)) + [1]:  # one primitive per row count, then the first again
        torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 32), w, b, "none", [None], "")
"""


def last_creation(mode: str) -> str:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}  # keep() may have run here
    done = subprocess.run([sys.executable, "-c", ONEDNN_SHAPES, mode], capture_output=True, text=True, timeout=300,
                          env={**env, "ONEDNN_VERBOSE": "2"}, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    created = [line for line in done.stdout.splitlines() if ",primitive,create:" in line]
    return created[-1].split(",")[3] if created else ""


@pytest.mark.skipif(not linear.probe(torch.device("cpu"), torch.float32),
                    reason="no oneDNN fp32 linear in this torch build: the generation engine does not use oneDNN")
def test_the_kernel_cache_keeps_what_a_burst_of_shapes_would_evict():
    """After 1,100 row counts (a few bursts' worth of step sizes) the first one's oneDNN primitive is
    still cached once heap.keep() ran, where oneDNN's default 1,024 entries had evicted it."""
    assert last_creation("keep") == "create:cache_hit"
    assert last_creation("default") == "create:cache_miss"  # the same shapes without keep(): evicted


def _full_collections() -> tuple[list[int], object]:
    """Collections of the oldest generation from now on: the walk of every object an unload must avoid."""
    seen: list[int] = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(count)
    return seen, count


def test_an_unload_whose_models_refcounting_freed_walks_nothing():
    try:
        model = torch.nn.Linear(4, 4)  # no cycle: its last reference going frees it
        heap.park()
        watched = heap.watch([model])
        del model
        frozen = gc.get_freeze_count()
        seen, count = _full_collections()
        try:
            heap.reclaim(watched)
        finally:
            gc.callbacks.remove(count)
        assert seen == []  # no collection at all
        assert gc.get_freeze_count() == frozen  # the parked heap was not handed back
    finally:
        heap.unpark()


def test_a_cycle_made_after_the_park_is_freed_without_unparking():
    try:
        heap.park()
        model = Node()  # loaded after the park: in the ordinary generations
        watched = heap.watch([model])
        del model
        frozen = gc.get_freeze_count()
        heap.reclaim(watched)
        assert watched[0]() is None
        assert gc.get_freeze_count() == frozen  # freed by the ordinary collection; the parked heap stayed parked
    finally:
        heap.unpark()


def test_a_watched_cycle_in_the_parked_heap_still_gets_the_full_collection():
    try:
        model = Node()
        heap.park()
        watched = heap.watch([model])
        del model
        heap.reclaim(watched)
        assert watched[0]() is None
        assert gc.get_freeze_count() > 0  # parked again
    finally:
        heap.unpark()


def test_what_cannot_be_watched_is_not_known():
    assert heap.watch(None) is None
    assert heap.watch([1, "weights"]) is None  # ints and strings take no weak references: reclaim collects all

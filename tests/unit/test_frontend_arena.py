"""The arena's allocator: first fit, aligned blocks, neighbours merged when freed, None when full."""

from __future__ import annotations

import random

from server.ipc.arena import ALIGN, Allocator


def test_blocks_are_aligned_disjoint_and_merge_back_into_one():
    alloc = Allocator(1024, 64 * ALIGN)
    rng = random.Random(3)
    held: dict[int, int] = {}
    for _ in range(2000):
        if held and (rng.random() < 0.5 or len(held) > 20):
            offset = rng.choice(list(held))
            alloc.free(offset)
            del held[offset]
            continue
        nbytes = rng.randint(1, 6 * ALIGN)
        offset = alloc.allocate(nbytes)
        if offset is None:  # full: only when no gap between the held blocks is large enough
            assert _largest_gap(held, 1024, 64 * ALIGN) < -(-nbytes // ALIGN) * ALIGN
            continue
        assert offset % ALIGN == 0 and 1024 <= offset and offset + nbytes <= 1024 + 64 * ALIGN
        for other, size in held.items():
            assert offset + nbytes <= other or other + size <= offset, "two blocks overlap"
        held[offset] = nbytes
    for offset in held:
        alloc.free(offset)
    assert alloc.used == 0
    assert alloc.allocate(64 * ALIGN) == 1024  # everything merged back into one free block


def test_full_answers_none_and_zero_size_arena_holds_nothing():
    alloc = Allocator(0, 2 * ALIGN)
    assert alloc.allocate(2 * ALIGN + 1) is None
    first = alloc.allocate(1)
    assert alloc.allocate(ALIGN) is not None and alloc.allocate(1) is None
    alloc.free(first)
    assert alloc.allocate(ALIGN) == first
    assert Allocator(0, 0).allocate(1) is None


def _largest_gap(held: dict[int, int], start: int, size: int) -> int:
    edges = sorted((o, o + -(-n // ALIGN) * ALIGN) for o, n in held.items())
    gaps, at = [], start
    for begin, end in edges:
        gaps.append(begin - at)
        at = end
    return max([*gaps, start + size - at])

"""glibc's allocator, set for an engine that runs big steps back to back: their tensors reuse the heap.

By default glibc serves an allocation above its mmap threshold (dynamic, at most 32 MiB) with a fresh
mapping and gives the top of the heap back to the kernel past its trim threshold. Either way the next
step's tensors of that size come from new pages that the kernel zeroes on first touch, one fault per
4 KiB. A generation step of `ferry batch`, 256 sequences wide, gathers tens of MiB of K/V per layer:
on the bench's model (bench/batch.py) a decode token of a 256-sequence step at 200 tokens of context
cost 440-570 us of CPU against 190-210 us in a 64-sequence step; with the threshold fixed at 32 MiB
and trimming off, 200-210 us in both (min of 5 runs each, single-threaded torch, a shared 2-core
machine). The cost: the process keeps its peak heap until it exits instead of handing it back
between steps, which a batch run that holds one model for its whole life does not miss.

`ferry serve` is not changed here (its steps are as wide as its clients make them); the same two
settings would help a server whose steps are that wide.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("ferry.batch")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: allocations up to this size come from the heap
TRIM_THRESHOLD = 2**31 - 1  # never give the heap's top back between steps


def keep_heap() -> bool:
    """Apply the settings; False where the C library is not glibc (nothing is changed there)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        done = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
    log.debug("heap kept between steps: %s", done)
    return done

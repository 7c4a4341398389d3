"""The long-lived heap: Python's cycle collector, and glibc's allocator.

Startup leaves millions of long-lived objects (torch, onnx, protobuf descriptors, the models). A full
collection walks every one of them: a stall of tens of ms for every request in flight, which set the
light benchmark model's p99. Once loading is done they are parked outside the collector. Parked
objects are still freed by reference counting; only a reference cycle among them would outlive its
use, so an unload hands everything back to the collector once and parks what survives.

glibc serves an allocation above its mmap threshold (dynamic, at most 32 MiB) with a fresh mapping and
gives the top of the heap back to the kernel past its trim threshold: either way the next step's
tensors of that size come from new pages the kernel zeroes on first touch, one fault per 4 KiB. A
generation step 256 sequences wide faulted 12,800-51,500 pages and cost a decode token 440-570 us of
CPU against 200-210 us with the threshold fixed at 32 MiB and trimming off (bench/batch.py's model, one
torch thread). So the server keeps its heap, as inference servers that preload tcmalloc or jemalloc do:
memory a peak took is reused by the next peak instead of handed back between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: allocations up to this size come from the heap
TRIM_THRESHOLD = 2**31 - 1  # never give the heap's top back between steps


def park() -> None:
    gc.collect()
    gc.freeze()


def reclaim() -> None:
    """After models were unloaded: collect what they left in cycles, park the rest again."""
    if gc.get_freeze_count():
        gc.unfreeze()
        park()


def keep() -> bool:
    """Apply the allocator settings; False where the C library is not glibc (nothing is changed there)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        done = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
    log.debug("heap kept between steps: %s", done)
    return done

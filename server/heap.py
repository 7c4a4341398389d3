"""The long-lived heap: Python's cycle collector, and glibc's allocator.

Startup leaves millions of long-lived objects (torch, onnx, protobuf descriptors, the models). A full
collection walks every one of them: a stall of tens of ms for every request in flight, which set the
light benchmark model's p99. Once loading is done they are parked outside the collector. Parked
objects are still freed by reference counting; only a reference cycle among them would outlive its
use, so an unload that leaves what its model held alive hands everything back to the collector once and
parks what survives; one whose model reference counting freed walks nothing (`reclaim`).

The youngest generation is collected every 700 net allocations of container objects by default, and a
request in flight holds about 40 of them (its message wrappers, dicts, future, coroutine frames, gRPC's
call state) for as long as it waits in a batching window: at 64 clients that is ~2,600 live young objects,
so the collector ran every ~17 requests and walked them all each time. Measured on the served light model
at 64 clients (bench/hotpath.py's load, gc.callbacks): collection time per request / longest pause were
4.9-8.3 us / 0.3-0.8 ms at 700, 2.7-3.2 us / 1.4-1.9 ms at 3,000, 1.7-2.3 us / 4.1-4.4 ms at 10,000. The
pause grows with the threshold while the saving flattens past what requests in flight hold: 3,000 after
startup.

glibc serves an allocation above its mmap threshold (dynamic, at most 32 MiB) with a fresh mapping and
gives the top of the heap back to the kernel past its trim threshold: either way the next step's
tensors of that size come from new pages the kernel zeroes on first touch, one fault per 4 KiB. A
generation step 256 sequences wide faulted 12,800-51,500 pages and cost a decode token 440-570 us of
CPU against 200-210 us with the threshold fixed at 32 MiB and trimming off (bench/batch.py's model, one
torch thread). So the server keeps its heap, as inference servers that preload tcmalloc or jemalloc do:
memory a peak took is reused by the next peak instead of handed back between steps.

The same goes for oneDNN's primitive cache (the matmul kernels the generation engine's Linear layers
run, server/backends/llm/linear.py): a primitive is made per input shape, a step's shape is its token
count, and bursts make hundreds of distinct ones. At oneDNN's default 1,024 entries a server that had
served bursts on three models evicted the kernels a quiet stream's small steps needed, and remaking
them stalled a 2-token decode step for 100-800 ms (5 of 6 runs of bench/generation.py's Poisson 2/s
load after its bursts had a 150-340 ms time to first token and up to 800 ms between two tokens; at
16,384 entries 3 of 3 runs stayed under 81 and 44 ms, for 13 MB more RSS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import weakref

log = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: allocations up to this size come from the heap
TRIM_THRESHOLD = 2**31 - 1  # never give the heap's top back between steps
GEN0_THRESHOLD = 3_000  # container allocations between two collections of the youngest generation (default 700)
_kept = False  # keep() set glibc's thresholds (trim() lowers the trim threshold for its call only)
ONEDNN_CACHE = "16384"  # oneDNN primitive cache entries (its default: 1,024), read at its first primitive


_parked = False  # park() ran and reclaim() has something to hand back (gc.get_freeze_count() walks the
# whole parked list to count it: 70 ms of the loop on a server with torch imported, on every unload)


def park() -> None:
    global _parked
    gc.collect()
    gc.freeze()
    _parked = True
    first, *older = gc.get_threshold()
    gc.set_threshold(max(first, GEN0_THRESHOLD), *older)  # a threshold set higher elsewhere is kept


def reclaim(watched: list[weakref.ref] | None = None) -> None:
    """After models were unloaded: collect what they left in cycles, park the rest again.

    Unparking walks every object the server holds: 75-95 ms of the event loop, a stall for every request
    in flight, on each explicit unload or reload (a py-spy of load/unload rounds on a server with torch
    imported). `watched`: weak references to what the unloaded models held (Backend.held). Where reference
    counting already freed all of it, nothing was left in a cycle worth a stall, and nothing is walked;
    where a cycle among objects made since the last park holds it, the ordinary collection (which walks
    only those) frees it; only a cycle reaching into the parked heap needs the full one. None: not known,
    so the full collection runs, as it does for every unload without weak references to go by."""
    if not _parked:
        return
    if watched is not None:
        if not any(ref() is not None for ref in watched):
            return
        gc.collect()
        if not any(ref() is not None for ref in watched):
            return
    gc.unfreeze()
    park()


def unpark() -> None:
    """Hand the parked heap back to the collector for good (tests that parked it leave it as they found it)."""
    global _parked
    gc.unfreeze()
    _parked = False


def watch(objects) -> list[weakref.ref] | None:
    """Weak references to `objects` for `reclaim`; None where they are not known (None) or one cannot be
    watched (no weak references)."""
    if objects is None:
        return None
    try:
        return [weakref.ref(obj) for obj in objects]
    except TypeError:
        return None


def keep() -> bool:
    """Apply the allocator and kernel cache settings, before any model loads. Returns whether glibc took
    the allocator's (False where the C library is not glibc: nothing is changed there). A capacity the
    environment already sets for oneDNN is kept."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE)
    try:
        libc = libc_handle()
        if libc is None or not hasattr(libc, "gnu_get_libc_version"):
            return False
        done = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
    log.debug("heap kept between steps: %s", done)
    global _kept
    _kept = done
    return done


def trim() -> None:
    """Hand the heap's free pages back to the kernel once (glibc's malloc_trim): after an eviction, so the
    memory the evicted model held shows as free to the next load's measurement and to the operator. The
    trim threshold `keep` raised also guards each thread arena's top, which malloc_trim alone leaves, so it
    is lowered for the call and raised again. It walks every arena, so callers on the event loop run it on
    a thread (ctypes lets the GIL go for the call)."""
    try:
        libc = libc_handle()
        if libc is None or not hasattr(libc, "malloc_trim"):
            return
        if _kept:
            libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)
        libc.malloc_trim(0)
        if _kept:
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    except OSError:
        pass


@functools.cache
def libc_handle() -> ctypes.CDLL | None:
    """The C library, looked up once: `find_library` runs `ldconfig -p` in a subprocess, which forked the
    whole server for every eviction under on-demand loading (bench/many_models.py's profile)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None

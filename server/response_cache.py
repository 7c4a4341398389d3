"""The response cache: answers to requests seen before, given back without queueing or running the model.

Triton's response cache, with its switches: the server holds one cache (`--cache-config local,size=BYTES`)
shared by every model whose config says `response_cache: {enable: true}`. A request's key hashes its
model, version (and which load of it), requested outputs and each input's name, datatype, shape and
bytes, so only a request identical in all of those is answered from the cache. Request parameters
such as priority or timeout change how a request is scheduled, not its answer, so they are left out.
Entries are read-only copies of the outputs, bounded in bytes, least recently used out first. Only a
deterministic model should enable it: a hit never runs the model.

Every call comes from the event loop, so nothing here locks; the metrics thread reads plain counters.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Awaitable, Callable, Protocol

import numpy as np

from server.request import InferRequest

_ENTRY_OVERHEAD = 256  # bytes charged per entry beyond its tensors (key, dict, array headers)


class CacheStats(Protocol):
    """Where a model records its lookups (metrics.ModelStats)."""

    def record_cache_hit(self, lookup_ns: int, total_ns: int) -> None: ...

    def record_cache_miss(self, lookup_and_insert_ns: int) -> None: ...


def request_key(scope: str, inputs: dict[str, np.ndarray], requested: tuple[str, ...]) -> bytes:
    """A 20-byte digest of everything that decides a request's answer; hashed over the input buffers,
    no element-wise Python except for BYTES tensors (whose elements are separate objects). `scope`
    names one load of one model version, and for an ensemble the loads of its steps too (a reload may
    bring new weights: it gets a new scope, and the old entries age out unused)."""
    digest = hashlib.blake2b(digest_size=20)
    digest.update(f"{scope}\0{','.join(requested)}".encode())
    for name in sorted(inputs):
        array = inputs[name]
        digest.update(f"\0{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        if array.dtype == object:
            for item in array.reshape(-1):
                data = item if isinstance(item, bytes) else str(item).encode()
                digest.update(len(data).to_bytes(8, "little"))
                digest.update(data)
        else:
            digest.update(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)
    return digest.digest()


def _size(outputs: dict[str, np.ndarray]) -> int:
    total = _ENTRY_OVERHEAD
    for array in outputs.values():
        total += sum(len(x) for x in array.reshape(-1)) if array.dtype == object else array.nbytes
    return total


def _frozen(array: np.ndarray) -> np.ndarray:
    copy = np.array(array, copy=True)  # owns its data: never a view into a batch's joined outputs
    copy.flags.writeable = False  # every hit shares it; an encoder that wrote into it would fail loudly
    return copy


class ResponseCache:
    """One least-recently-used map of request keys to outputs, bounded in bytes."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"the response cache needs a size in bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.used = 0
        self.hits = self.misses = self.evictions = self.too_large = 0
        self._entries: OrderedDict[bytes, tuple[dict[str, np.ndarray], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> dict[str, np.ndarray] | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[0]

    def put(self, key: bytes, outputs: dict[str, np.ndarray]) -> bool:
        """Keep a copy of `outputs` under `key`, evicting the least recently used entries to make room;
        False when one answer alone is larger than the whole cache (it is then not kept)."""
        if key in self._entries:  # an identical request was answered while this one ran
            self._entries.move_to_end(key)
            return True
        size = _size(outputs) + len(key)
        if size > self.capacity:
            self.too_large += 1
            return False
        while self.used + size > self.capacity:
            _, (_, freed) = self._entries.popitem(last=False)
            self.used -= freed
            self.evictions += 1
        self._entries[key] = ({name: _frozen(array) for name, array in outputs.items()}, size)
        self.used += size
        return True


async def answer(cache: ResponseCache, scope: str, request: InferRequest, stats: CacheStats,
                 run: Callable[[InferRequest], Awaitable[dict[str, np.ndarray]]]) -> dict[str, np.ndarray]:
    """`request`'s outputs from the cache when an identical request was answered before; otherwise
    `run(request)`, whose answer is kept. A failed or cancelled run keeps nothing."""
    started = time.monotonic_ns()
    key = request_key(scope, request.inputs, request.requested_outputs)
    outputs = cache.get(key)
    if outputs is not None:
        now = time.monotonic_ns()
        stats.record_cache_hit(now - started, now - request.arrival_ns)
        return outputs
    lookup_ns = time.monotonic_ns() - started
    outputs = await run(request)
    started = time.monotonic_ns()
    cache.put(key, outputs)
    stats.record_cache_miss(lookup_ns + time.monotonic_ns() - started)
    return outputs

"""The records that travel from the servicer through a scheduler to a worker and back.

Plain dataclasses: no protobuf, grpc or torch, so every layer below rpc/ can build and inspect them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.errors import BackendError


@dataclass(slots=True, eq=False)
class InferRequest:
    """One client request, decoded and validated against its model's signature."""

    model_name: str
    inputs: dict[str, np.ndarray]
    batch_size: int  # rows along dim 0 for batching models, 1 otherwise
    batch_key: tuple  # requests with equal keys can be joined along dim 0
    id: str = ""
    requested_outputs: tuple[str, ...] = ()  # empty: all outputs
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: int = 0  # resolved level: 1 is the highest
    timeout_us: int = 0  # the request's own `timeout` parameter (0: none)
    deadline_ns: int | None = None  # monotonic; the RPC's deadline until the queue folds in its policy
    arrival_ns: int = 0  # monotonic time the servicer received it
    enqueue_ns: int = 0
    sequence: int = 0  # admission order, set by the queue; ties broken by it
    timeout_action: str = "REJECT"  # what the queue does at the deadline: REJECT or DELAY
    length: int = 0  # along the model's variable-length dimension (0: the model has none)
    cost: float = 0.0  # the request's `cost` parameter, per row (0: derive it from the length)
    group_key: tuple | None = None  # the queue group holding it; written only by scheduling.queue
    slot: Any = None  # the queue lane holding it while queued; written only by scheduling.queue
    lane: int = 0  # that lane's rank: level - 1, or one past the lowest level once DELAYed
    future: Any = None  # completion handle owned by the model runner; opaque to schedulers

    def expired(self, now_ns: int) -> bool:
        return self.deadline_ns is not None and now_ns >= self.deadline_ns


@dataclass(slots=True, eq=False)
class Batch:
    """Requests a scheduler chose to run together in one backend call."""

    requests: list[InferRequest]
    batched: bool  # True: join along dim 0; False: the single request runs as sent
    bucket: int | None = None  # the cost bucket it was drawn from (binpack), for the metrics page

    @property
    def size(self) -> int:
        return sum(r.batch_size for r in self.requests)

    def gather_inputs(self) -> dict[str, np.ndarray]:
        """Join every input along dim 0: one copy per input, none for a single request."""
        first = self.requests[0]
        if len(self.requests) == 1:
            return first.inputs
        return {name: join_rows([r.inputs[name] for r in self.requests]) for name in first.inputs}

    def scatter_outputs(self, outputs: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """Split batch outputs back per request as views; refuse outputs whose rows do not add up."""
        if not self.batched:
            return [outputs]
        total = self.size
        for name, value in outputs.items():
            if value.ndim == 0 or value.shape[0] != total:
                raise BackendError(
                    f"output '{name}' has shape {list(value.shape)} but the batch has {total} rows; "
                    "a batching model must return one row per input row"
                )
        results, start = [], 0
        for request in self.requests:
            stop = start + request.batch_size
            results.append({name: value[start:stop] for name, value in outputs.items()})
            start = stop
        return results


def join_rows(arrays: list[np.ndarray]) -> np.ndarray:
    """np.concatenate along dim 0, copying every part without letting go of the GIL.

    NumPy releases the GIL around each part's copy. With another thread busy in Python, every part
    then waits up to the switch interval (5 ms) to get it back: 23 parts of 64 KiB took 57 ms instead
    of 0.05 ms next to one busy thread. Copying through memoryviews keeps the GIL for the whole
    (short) copy. Anything unusual (see copies_as_bytes, or parts that disagree) goes to
    np.concatenate, which also raises the errors.
    """
    first = arrays[0]
    rest = first.shape[1:]
    if any(a.shape[1:] != rest for a in arrays) or not copies_as_bytes(arrays, first.dtype):
        return np.concatenate(arrays)
    out = np.empty((sum(a.shape[0] for a in arrays), *rest), first.dtype)
    target, start = memoryview(out).cast("B"), 0
    for a in arrays:
        target[start:start + a.nbytes] = memoryview(a).cast("B")
        start += a.nbytes
    return out


def copies_as_bytes(arrays: list[np.ndarray], dtype: np.dtype) -> bool:
    """Whether every part can be copied as raw bytes into an array of `dtype`: the same plain dtype,
    C-contiguous, and a dtype Python's buffer protocol can describe (extension dtypes may not)."""
    if dtype.hasobject or any(a.dtype != dtype or not a.flags.c_contiguous for a in arrays):
        return False
    try:
        memoryview(arrays[0])
    except (TypeError, ValueError):
        return False
    return True

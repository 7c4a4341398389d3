"""The records that travel from the servicer through a scheduler to a worker and back.

Plain dataclasses: no protobuf, grpc or torch, so every layer below rpc/ can build and inspect them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
    nbytes: int = 0  # the input data it holds while queued, charged to its model's and the server's byte budget
    group_key: tuple | None = None  # the queue group holding it; written only by scheduling.queue
    slot: Any = None  # the queue lane holding it while queued; written only by scheduling.queue
    lane: int = 0  # that lane's rank: level - 1, or one past the lowest level once DELAYed
    future: Any = None  # completion handle owned by the model runner; opaque to schedulers
    trace: Any = None  # a sampled request's tracing.record.Trace; None (almost always): not traced
    caller_left: Any = None  # set by a backend running it elsewhere (a model process): called when its caller leaves mid-run
    correlation_id: int | str = 0  # its sequence's, set by the runner of a sequence model (0: none)
    sequence_flags: int = 0  # Triton's request flags for that sequence: 1 its start, 2 its end
    rerun: Any = None  # set by an iterative sequence's runner: readies a request the model rescheduled for its next run
    cancel: Any = None  # set by a decoupled runner while it holds it: Triton's request cancellation (a BLS iterator's
    # cancel()): a queued request ends CANCELLED, a running one's is_cancelled() turns true and its responses still come

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

    @property
    def train(self) -> bool:
        """Several requests of a model that does not batch, sent on together and each run by an execute of
        its own (Backend.train_limit): one hop to the backend for all of them."""
        return not self.batched and len(self.requests) > 1

    @property
    def executions(self) -> int:
        return len(self.requests) if self.train else 1


class Outputs(dict):
    """One response's outputs (name -> array) with the parameters the model set on it: Triton's response
    parameters (`pb_utils.InferenceResponse(..., parameters={...})`), str -> bool, int or str. A plain
    dict everywhere else, so only the layers that rebuild a response's dict (reshape, classification,
    requested outputs) and the doors that encode it need to know (`with_parameters_of`)."""

    __slots__ = ("parameters", "final")

    def __init__(self, arrays=(), parameters: dict[str, bool | int | str] | None = None, final: bool = False):
        super().__init__(arrays)
        self.parameters = dict(parameters or {})
        self.final = final  # a decoupled model sent it with its final flag (no empty last response follows)


def parameters_of(outputs: dict) -> dict[str, bool | int | str]:
    """The response parameters a response's outputs carry ({} for a plain dict)."""
    return getattr(outputs, "parameters", None) or {}


def with_parameters_of(rebuilt: dict, original: dict) -> dict:
    """`rebuilt` (a new dict made from `original`'s arrays) keeping `original`'s response parameters."""
    params, final = parameters_of(original), is_final(original)
    return Outputs(rebuilt, params, final) if params or final else rebuilt


def is_final(outputs: dict) -> bool:
    """Whether a decoupled model sent this response with its final flag (Triton's COMPLETE_FINAL)."""
    return getattr(outputs, "final", False)


class _Rescheduled(Outputs):
    """The answer of a model that released a request to run it again later (Triton's request
    rescheduling, `TRITONSERVER_REQUEST_RELEASE_RESCHEDULE`): no response yet; the batching runner
    queues the request again (after its `rerun`)."""

    __slots__ = ()


RESCHEDULED = _Rescheduled()

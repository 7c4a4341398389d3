"""One sampled request's trace: Triton's timestamps, taken where the request passes.

A request that is not sampled carries `trace = None`, so below the front door tracing off costs one
attribute check. Timestamps are monotonic nanoseconds (Triton's steady clock), appended in the order
they are taken; the file writer and the OpenTelemetry exporter read them once the trace is finished.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from server.tensors.datatypes import from_numpy

# Triton's names, in the order one request passes them (gRPC; HTTP_RECV_*/HTTP_SEND_* for HTTP).
GRPC_WAITREAD_START, GRPC_WAITREAD_END = "GRPC_WAITREAD_START", "GRPC_WAITREAD_END"
HTTP_RECV_START, HTTP_RECV_END = "HTTP_RECV_START", "HTTP_RECV_END"
REQUEST_START, QUEUE_START = "REQUEST_START", "QUEUE_START"
COMPUTE_START, COMPUTE_INPUT_END = "COMPUTE_START", "COMPUTE_INPUT_END"
COMPUTE_OUTPUT_START, COMPUTE_END = "COMPUTE_OUTPUT_START", "COMPUTE_END"
INFER_RESPONSE_COMPLETE, REQUEST_END = "INFER_RESPONSE_COMPLETE", "REQUEST_END"
GRPC_SEND_START, GRPC_SEND_END = "GRPC_SEND_START", "GRPC_SEND_END"
HTTP_SEND_START, HTTP_SEND_END = "HTTP_SEND_START", "HTTP_SEND_END"
FIRST_TOKEN = "FIRST_TOKEN"  # generation: Ferry's addition; every streamed response adds INFER_RESPONSE_COMPLETE
# level TENSORS: a request's inputs as they enter its model's queue, its outputs as the model answered them
TENSOR_QUEUE_INPUT, TENSOR_BACKEND_OUTPUT = "TENSOR_QUEUE_INPUT", "TENSOR_BACKEND_OUTPUT"


class Trace:
    """The record of one sampled request (or a child request: an ensemble step's or a BLS call's, with
    `parent_id`)."""

    __slots__ = ("id", "model_name", "model_version", "request_id", "parent_id", "timestamps", "tensors",
                 "attributes", "span", "links", "parent", "owner", "control", "_done", "_finish", "tensor_level")

    def __init__(self, trace_id: int, model_name: str, finish: Callable[[Trace], None], request_id: str = "",
                 parent: Trace | None = None, tensor_level: bool = False):
        self.id = trace_id
        self.model_name = model_name
        self.model_version = -1  # known once the front door found the version
        self.request_id = request_id
        self.parent = parent
        self.parent_id = parent.id if parent is not None else None
        self.timestamps: list[tuple[str, int]] = []
        self.tensors: list[tuple[str, str, np.ndarray]] = []  # (activity, name, array), level TENSORS only
        self.attributes: dict[str, Any] = {}  # for OpenTelemetry: batch size, instance, token counts, ...
        self.span = None  # the OpenTelemetry span, in that mode
        self.links: list = []  # span contexts of the batches this request rode in
        self.tensor_level = tensor_level
        self.owner = parent.owner if parent is not None else None  # the sampler that took it (tracing/control.py)
        self.control = parent.control if parent is not None else None  # the TraceControl (its exporter)
        self._done = False
        self._finish = finish

    def mark(self, name: str, ns: int | None = None) -> None:
        self.timestamps.append((name, time.monotonic_ns() if ns is None else ns))

    def tensor(self, activity: str, tensors: dict[str, np.ndarray]) -> None:
        """Level TENSORS: keep the tensors (`TENSOR_QUEUE_INPUT`, `TENSOR_BACKEND_OUTPUT`) for the file."""
        if self.tensor_level:
            self.tensors.extend((activity, name, array) for name, array in tensors.items())

    def child(self, model_name: str, model_version: int, new_id: Callable[[], int]) -> Trace:
        """A child request (an ensemble step, a BLS call): its own id, `parent_id` this trace's."""
        child = Trace(new_id(), model_name, self._finish, self.request_id, self, self.tensor_level)
        child.model_version = model_version
        return child

    def finish(self) -> None:
        """Hand the trace to its writer once (a failed request is finished by whoever saw it fail)."""
        if not self._done:
            self._done = True
            self._finish(self)

    def first(self, name: str) -> int | None:
        return next((ns for n, ns in self.timestamps if n == name), None)

    def entries(self) -> list[dict]:
        """The trace as Triton 2.51 writes it: a header, then one entry per timestamp (and per tensor)."""
        header = {"id": self.id, "model_name": self.model_name, "model_version": self.model_version,
                  "request_id": self.request_id}
        if self.parent_id is not None:
            header["parent_id"] = self.parent_id
        out = [header]
        out.extend({"id": self.id, "timestamps": [{"name": name, "ns": ns}]} for name, ns in self.timestamps)
        out.extend({"id": self.id, "activity": activity, "tensor": _tensor(name, array)}
                   for activity, name, array in self.tensors)
        return out


def _tensor(name: str, array: np.ndarray) -> dict:
    flat = array.reshape(-1)
    if array.dtype == object or array.dtype.kind in "SU":
        data = ",".join(_text(v) for v in flat)
    else:
        data = ",".join(str(v) for v in flat.tolist())
    return {"name": name, "data": data, "shape": ",".join(map(str, array.shape)), "dtype": _dtype(array.dtype)}


def _dtype(dtype) -> str:
    try:
        return from_numpy(dtype).api
    except TypeError:
        return str(dtype)


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def step_trace(parent: Trace, model_name: str, model_version: int, inputs: dict[str, np.ndarray]) -> Trace:
    """An ensemble step's request's trace (`parent_id`: the ensemble request's), REQUEST_START taken now and,
    at level TENSORS, the step's inputs (what Triton's trace_summary.py prints as the ensemble's data flow)."""
    child = parent.control.child(parent, model_name, model_version)
    child.mark(REQUEST_START)
    child.tensor(TENSOR_QUEUE_INPUT, inputs)
    return child


def call_trace(parent: Trace, model_name: str, model_version: int, request_id: str = "",
               started: bool = True) -> Trace:
    """A BLS call's trace: a child of the calling request's, as an ensemble step's is. `request_id`: the
    call's own when model code gave one (else the caller's); `started`: REQUEST_START taken now (a
    generation's is taken once its prompt is decoded, doors.GenerationTrace.started)."""
    child = parent.control.child(parent, model_name, model_version)
    if request_id:
        child.request_id = request_id
    if started:
        child.mark(REQUEST_START)
    return child


def ended(trace: Trace, error: str | None = None) -> None:
    """A child request is over, answered, failed or cancelled: REQUEST_END unless its runner took it
    (a generation's last token does), and the trace goes to its writer."""
    if error is not None:
        trace.attributes.setdefault("error", error)
    if trace.first(REQUEST_END) is None:
        trace.mark(REQUEST_END)
    trace.finish()

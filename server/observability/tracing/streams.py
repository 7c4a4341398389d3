"""ModelStreamInfer traced: each request on the stream is a trace of its own, as in Triton.

The stream reads a request: GRPC_WAITREAD_START/END at that moment (gRPC has read the message by
then). The request runs as the same call would alone (ModelInfer's REQUEST_START .. REQUEST_END, a
decoupled model's INFER_RESPONSE_COMPLETE per response, a generation's FIRST_TOKEN and per-token
timestamps). Each of its responses goes to the stream's writer wrapped in a `Sending`: the writer
marks GRPC_SEND_START before handing it to gRPC and GRPC_SEND_END once gRPC asks for the next one (it
has written this one), and ends the trace after the request's last response. A request that is not
sampled puts its bare response on the stream, as before.
"""

from __future__ import annotations

from typing import Any

from server.observability.tracing import record as r
from server.observability.tracing.doors import grpc_carrier


class Sending:
    """One response of a traced request, on its way to the stream's writer; `last`: the trace ends once
    it is written (`response` None: the request's responses are over, nothing more to write)."""

    __slots__ = ("response", "trace", "last")

    def __init__(self, response: Any, trace: r.Trace, last: bool):
        self.response, self.trace, self.last = response, trace, last

    def writing(self) -> None:
        self.trace.mark(r.GRPC_SEND_START)

    def written(self) -> None:
        self.trace.mark(r.GRPC_SEND_END)

    def done(self) -> None:
        if self.last:
            self.trace.finish()


class StreamTracing:
    """The stream's way to the server's TraceControl; the stream's metadata (a W3C traceparent) is
    read once, by the first request sampled, and parents every traced request on the stream."""

    __slots__ = ("control", "context", "_carrier")

    def __init__(self, control, context):
        self.control, self.context = control, context
        self._carrier: dict[str, str] | None = None

    @property
    def active(self) -> bool:
        return self.control.active

    def begin(self, model: str, request_id: str, arrival_ns: int) -> r.Trace | None:
        if self._carrier is None:
            self._carrier = grpc_carrier(self.context)
        trace = self.control.begin(model, request_id, arrival_ns, self._carrier)
        if trace is not None:
            trace.mark(r.GRPC_WAITREAD_START, arrival_ns)
            trace.mark(r.GRPC_WAITREAD_END, arrival_ns)
        return trace


def failed(trace: r.Trace, message: str) -> None:
    trace.attributes["error"] = message


def abandoned(trace: r.Trace | None) -> None:
    """The stream ended (the client left, or a request's task was cancelled) before this trace's last
    response was written: the trace ends now with what it has."""
    if trace is not None:
        trace.attributes.setdefault("error", "the stream ended before the request's last response was sent")
        trace.finish()

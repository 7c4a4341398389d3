"""ModelInfer served by a front-end process (`--frontend-processes N`): one trace, kept by the engine.

The engine owns what tracing owns in one process: the settings (TraceSetting is relayed to it), the
sampling counters and the one trace file (or OpenTelemetry exporter), so the file stays one valid
JSON array (or Triton's count-sharded files) whichever front end served a request. The front end
reads and decodes the call and writes its answer; its timestamps reach the engine as plain integers
over the arena link, because CLOCK_MONOTONIC (Python's `monotonic_ns`) is one clock for every process
on the machine:

- the arrival travels in the call (InferCall.arrival_ns): GRPC_WAITREAD_START/END;
- the engine samples the call and marks REQUEST_START .. REQUEST_END as for a call of its own; a traced
  answer says so (a TRACED frame in place of DONE), and the engine keeps the trace open;
- the front end marks GRPC_SEND_START when it hands the answer to gRPC and GRPC_SEND_END when the call
  is over, and sends both (SENT); the engine adds them and ends the trace. A link that is lost ends the
  traces still waiting with what they have.

The front end learns whether tracing is on at all from a TRACING frame (at connection, and whenever
the settings change), so with tracing off it does no work for it; when on, it forwards the call's
W3C `traceparent` / `tracestate` metadata, which parents the request's span in OpenTelemetry mode.
"""

from __future__ import annotations

from typing import Mapping

from server.observability.tracing import record as r

CARRIED = ("traceparent", "tracestate")


def carrier(context) -> dict[str, str]:
    """The call's W3C trace context headers (front end side), for the engine's `begin`."""
    return {key: value for key, value in (context.invocation_metadata() or ()) if key in CARRIED}


def begin(control, model: str, request_id: str, arrival_ns: int, headers: Mapping[str, str] | None) -> r.Trace | None:
    """Engine side: the call's trace if it is sampled, its read marked at the front end's arrival."""
    trace = control.begin(model, request_id, arrival_ns, headers)
    if trace is not None:
        trace.mark(r.GRPC_WAITREAD_START, arrival_ns)
        trace.mark(r.GRPC_WAITREAD_END, arrival_ns)
    return trace


def sent(trace: r.Trace, start_ns: int | None, end_ns: int | None) -> None:
    """The front end's SENT frame: its send's timestamps (None: its caller had left), then the end."""
    if start_ns is not None and end_ns is not None:
        trace.mark(r.GRPC_SEND_START, start_ns)
        trace.mark(r.GRPC_SEND_END, end_ns)
    else:
        trace.attributes.setdefault("error", "the caller left before the answer was sent")
    trace.finish()


def ended(trace: r.Trace, error: str) -> None:
    """A traced call answered with an error, cancelled, or whose front end went away: it ends here."""
    trace.attributes.setdefault("error", error)
    trace.finish()

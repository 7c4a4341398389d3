"""OpenTelemetry mode: each sampled request becomes spans, exported over OTLP/HTTP by the SDK.

One span per request (its parent: the client's W3C `traceparent`, or the ensemble's span for a step),
with child spans for receive, queue, compute (batch assembly, execute, output) and send, and every
Triton timestamp as an event. One span per batch that carried a traced request, linked from each of
those requests' spans (batch size, requests, padding, instance). Generation spans carry the GenAI
semantic-convention attributes. Export runs on the SDK's BatchSpanProcessor thread: a slow or dead
collector never blocks a request; spans it could not take are dropped and counted (`dropped`).

Our timestamps are monotonic (Triton's steady clock); OpenTelemetry's are wall-clock, so each is moved
by one offset taken at start.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Mapping

from opentelemetry import trace as otel_trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from server import __version__
from server.observability.tracing import record as r
from server.observability.tracing.settings import OtelOptions

log = logging.getLogger(__name__)
EXPORT_TIMEOUT_S = 5.0  # one export's bound, retries included; a dead collector costs the exporter thread this
CLOSE_TIMEOUT_S = 10.0  # shutdown waits this long for the last spans, then leaves them
# (name, start, end, parent span name) of each child span, when both timestamps were taken.
_CHILDREN = (
    ("receive", r.HTTP_RECV_START, r.HTTP_RECV_END, None),
    ("queue", r.QUEUE_START, r.COMPUTE_START, None),
    ("compute", r.COMPUTE_START, r.COMPUTE_END, None),
    ("batch assembly", r.COMPUTE_START, r.COMPUTE_INPUT_END, "compute"),
    ("execute", r.COMPUTE_INPUT_END, r.COMPUTE_OUTPUT_START, "compute"),
    ("output", r.COMPUTE_OUTPUT_START, r.COMPUTE_END, "compute"),
    ("send", r.GRPC_SEND_START, r.GRPC_SEND_END, None),
    ("send", r.HTTP_SEND_START, r.HTTP_SEND_END, None),
)


class _Counting(SpanExporter):
    """The OTLP exporter, counting the spans it could not deliver."""

    def __init__(self, inner: SpanExporter):
        self.inner = inner
        self.failed = 0
        self.exported = 0

    def export(self, spans) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # noqa: BLE001 - a broken exporter drops its spans, never the server
            result = SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class _Processor(BatchSpanProcessor):
    """The SDK's batch processor, counting the spans it drops because its queue is full."""

    def __init__(self, exporter: SpanExporter, options: OtelOptions):
        super().__init__(exporter, max_queue_size=options.max_queue_size,
                         schedule_delay_millis=options.schedule_delay_ms,
                         max_export_batch_size=min(options.max_export_batch_size, options.max_queue_size))
        self.max_queue_size = options.max_queue_size
        self.overflowed = 0

    def on_end(self, span) -> None:
        queue = getattr(self._batch_processor, "_queue", None)
        if queue is not None and len(queue) >= self.max_queue_size:
            self.overflowed += 1
        super().on_end(span)


class OtelExporter:
    def __init__(self, options: OtelOptions, exporter: SpanExporter | None = None):
        attributes = {"service.name": "ferry", "service.version": __version__, **dict(options.resource)}
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.exporter = _Counting(exporter or OTLPSpanExporter(endpoint=options.url or None,
                                                                    timeout=EXPORT_TIMEOUT_S))
        self.processor = _Processor(self.exporter, options)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("ferry", __version__)
        self.propagator = TraceContextTextMapPropagator()
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    @property
    def dropped(self) -> int:
        """Spans lost: refused by the collector (or none reached), or beyond the export queue."""
        return self.exporter.failed + self.processor.overflowed

    def wall(self, ns: int) -> int:
        return ns + self.offset_ns

    def start(self, trace: r.Trace, carrier: Mapping[str, str] | None, start_ns: int | None = None) -> None:
        """Open the request's span now, so ensemble steps can be its children; it ends at `finish`."""
        if trace.parent is not None and trace.parent.span is not None:
            context = otel_trace.set_span_in_context(trace.parent.span)
            kind = SpanKind.INTERNAL
        else:
            context = self.propagator.extract(carrier) if carrier else None
            kind = SpanKind.SERVER
        start = time.monotonic_ns() if start_ns is None else start_ns
        trace.span = self.tracer.start_span(f"infer {trace.model_name}", context=context, kind=kind,
                                            start_time=self.wall(start))

    def batch(self, model: str, size: int, requests: int, padded: int, instance: str, start_ns: int,
              end_ns: int):
        """One batch's span (ended at once); returns its context for the requests' links."""
        span = self.tracer.start_span(f"batch {model}", kind=SpanKind.INTERNAL, start_time=self.wall(start_ns),
                                      attributes={"ferry.batch.size": size, "ferry.batch.requests": requests,
                                                  "ferry.batch.padded_positions": padded,
                                                  "ferry.instance": instance, "model_name": model})
        span.end(end_time=self.wall(end_ns))
        return span.get_span_context()

    def finish(self, trace: r.Trace) -> None:
        span = trace.span
        if span is None:
            return
        span.set_attributes({"model_name": trace.model_name, "model_version": trace.model_version,
                             "request_id": trace.request_id, "trace_id": trace.id})
        if trace.parent_id is not None:
            span.set_attribute("parent_id", trace.parent_id)
        name = trace.attributes.pop("span.name", None)
        error = trace.attributes.pop("error", None)
        span.set_attributes(trace.attributes)
        if name:
            span.update_name(name)
        for link in trace.links:
            span.add_link(link)
        for stamp, ns in trace.timestamps:
            span.add_event(stamp, timestamp=self.wall(ns))
        self._children(trace)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        end = max((ns for _, ns in trace.timestamps), default=time.monotonic_ns())
        span.end(end_time=self.wall(end))

    def _children(self, trace: r.Trace) -> None:
        made = {}
        for name, start_name, end_name, parent in _CHILDREN:
            start, end = trace.first(start_name), trace.first(end_name)
            if start is None or end is None:
                continue
            holder = made.get(parent, trace.span)
            child = self.tracer.start_span(name, context=otel_trace.set_span_in_context(holder),
                                           start_time=self.wall(start))
            child.end(end_time=self.wall(max(start, end)))
            made[name] = child

    def close(self) -> None:
        """Export what is queued, within CLOSE_TIMEOUT_S (a dead collector must not hold up the stop)."""
        done = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        done.start()
        done.join(CLOSE_TIMEOUT_S)
        if self.dropped:
            log.warning("OpenTelemetry: %d spans could not be exported (collector unreachable or queue full)",
                        self.dropped)


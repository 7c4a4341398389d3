"""The batching runner's one call into tracing: a batch's timestamps, once per batch, onto its traced requests."""

from __future__ import annotations

import time

from server.observability.tracing import record as r


def batch_ran(traced: list, model: str, size: int, requests: int, padded: int, instance: str, result) -> None:
    """`traced`: the batch's requests that carry a trace; `result`: the worker's BatchResult. Marks Triton's
    compute timestamps and INFER_RESPONSE_COMPLETE (the answers are set next); in OpenTelemetry mode
    makes the batch's span and links every traced request's span to it."""
    start, execute = result.started_ns, result.execute_ns
    output = execute + result.infer_ns
    end = output + result.output_ns
    now = time.monotonic_ns()
    otel = traced[0].trace.control.otel
    link = otel.batch(model, size, requests, padded, instance, start, end) if otel is not None else None
    for request in traced:
        trace = request.trace
        trace.timestamps += ((r.COMPUTE_START, start), (r.COMPUTE_INPUT_END, execute),
                             (r.COMPUTE_OUTPUT_START, output), (r.COMPUTE_END, end), (r.INFER_RESPONSE_COMPLETE, now))
        if link is not None:
            trace.links.append(link)
            trace.attributes["ferry.batch.size"] = size
            trace.attributes["ferry.instance"] = instance

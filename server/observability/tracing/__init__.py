"""Triton's trace extension and OpenTelemetry tracing: settings, sampling, the per-request record, writers.

`control.TraceControl` is what the app builds and the front doors ask (`begin`); `record.Trace` is what
a sampled request carries down to the runner and worker; `batches.batch_ran` is the runner's one call.
"""

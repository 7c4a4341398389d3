"""Every figure Ferry reports, recorded once and read two ways: ModelStatistics and Prometheus.

Counters are cumulative and monotonic (perf_analyzer diffs two snapshots). Prometheus names follow
Triton's so existing dashboards keep working; histograms are added for what Triton's counters
cannot answer (p99 across replicas, formed batch sizes).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS_US = (100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000, 5_000_000)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class PrometheusFamilies:
    """The metric families of one server, registered on its own registry (no global state)."""

    def __init__(self, registry: CollectorRegistry):
        labels = ("model", "version")

        def counter(name, doc):
            return Counter(name, doc, labels, registry=registry)

        def histogram(name, doc, buckets=_LATENCY_BUCKETS_US):
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.success = counter("nv_inference_request_success", "Successful inference requests")
        self.failure = counter("nv_inference_request_failure", "Failed inference requests")
        self.inferences = counter("nv_inference_count", "Inferences performed (batch rows)")
        self.executions = counter("nv_inference_exec_count", "Model executions (batches)")
        self.request_us = counter("nv_inference_request_duration_us", "Cumulative end-to-end request time")
        self.queue_us = counter("nv_inference_queue_duration_us", "Cumulative queue time")
        self.input_us = counter("nv_inference_compute_input_duration_us", "Cumulative input preparation time")
        self.infer_us = counter("nv_inference_compute_infer_duration_us", "Cumulative model execution time")
        self.output_us = counter("nv_inference_compute_output_duration_us", "Cumulative output extraction time")
        self.pending = Gauge("nv_inference_pending_request_count", "Requests queued, not yet executing", labels, registry=registry)
        self.batch_size = histogram("ferry_batch_size", "Rows per executed batch", _BATCH_BUCKETS)
        self.queue_hist = histogram("ferry_queue_duration_us", "Time from enqueue to dispatch")
        self.compute_hist = histogram("ferry_compute_duration_us", "Batch compute time (input + infer + output)")
        self.request_hist = histogram("ferry_request_duration_us", "End-to-end request time in the server")


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass(slots=True)
class BatchTimes:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


class ModelStats:
    """Figures of one model version. Written from the event loop, read by RPCs and scrapes."""

    def __init__(self, model: str, version: int, families: PrometheusFamilies | None):
        self.model, self.version = model, version
        self.success, self.fail, self.queue = Duration(), Duration(), Duration()
        self.compute_input, self.compute_infer, self.compute_output = Duration(), Duration(), Duration()
        self.inference_count = self.execution_count = self.last_inference_ms = 0
        self.batches: dict[int, BatchTimes] = {}
        self._lock = threading.Lock()  # the metrics HTTP thread reads while the loop writes
        self._labels = None
        self._children: dict = {}
        if families is not None:
            self._families = families
            self._labels = {"model": model, "version": str(version)}

    def _prom(self, name: str):
        child = self._children.get(name)
        if child is None:
            child = self._children[name] = getattr(self._families, name).labels(**self._labels)
        return child

    def record_batch(self, rows: int, requests: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        with self._lock:
            self.execution_count += 1
            self.inference_count += rows
            times = self.batches.setdefault(rows, BatchTimes())
            times.compute_input.add(input_ns)
            times.compute_infer.add(infer_ns)
            times.compute_output.add(output_ns)
            # Triton charges each request of a batch with the batch's compute times.
            self.compute_input.add(input_ns * requests, requests)
            self.compute_infer.add(infer_ns * requests, requests)
            self.compute_output.add(output_ns * requests, requests)
        if self._labels:
            self._prom("executions").inc()
            self._prom("inferences").inc(rows)
            self._prom("batch_size").observe(rows)
            self._prom("compute_hist").observe((input_ns + infer_ns + output_ns) / 1000)
            self._prom("input_us").inc(input_ns * requests / 1000)
            self._prom("infer_us").inc(infer_ns * requests / 1000)
            self._prom("output_us").inc(output_ns * requests / 1000)

    def record_queued(self, queue_ns: int) -> None:
        with self._lock:
            self.queue.add(queue_ns)
        if self._labels:
            self._prom("queue_us").inc(queue_ns / 1000)
            self._prom("queue_hist").observe(queue_ns / 1000)

    def record_done(self, total_ns: int, ok: bool) -> None:
        with self._lock:
            (self.success if ok else self.fail).add(total_ns)
            self.last_inference_ms = int(time.time() * 1000)
        if self._labels:
            self._prom("success" if ok else "failure").inc()
            if ok:
                self._prom("request_us").inc(total_ns / 1000)
                self._prom("request_hist").observe(total_ns / 1000)

    def set_pending(self, count: int) -> None:
        if self._labels:
            self._prom("pending").set(count)

    def snapshot(self) -> dict:
        """A consistent copy for the statistics RPC."""
        with self._lock:
            return {
                "success": (self.success.count, self.success.ns), "fail": (self.fail.count, self.fail.ns),
                "queue": (self.queue.count, self.queue.ns),
                "compute_input": (self.compute_input.count, self.compute_input.ns),
                "compute_infer": (self.compute_infer.count, self.compute_infer.ns),
                "compute_output": (self.compute_output.count, self.compute_output.ns),
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                "last_inference": self.last_inference_ms,
                "batches": {
                    size: {k: (getattr(t, k).count, getattr(t, k).ns) for k in ("compute_input", "compute_infer", "compute_output")}
                    for size, t in sorted(self.batches.items())
                },
            }

"""Every figure Ferry reports, recorded once in ModelStats and read two ways: ModelStatistics and Prometheus.

Counters are cumulative and monotonic (perf_analyzer diffs two snapshots). The Prometheus page is
rendered from the same ModelStats at scrape time, so the two views cannot disagree. Names follow
Triton's (`nv_inference_*`, no `_total` suffix, as Triton exposes them) so existing dashboards keep
working; `ferry_*` histograms add what Triton's counters cannot answer: p99 across replicas and the
sizes of the batches actually formed.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from server.errors import BackendError, DeadlineExceededError, QueueFullError

_LATENCY_BUCKETS_US = (100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000, 5_000_000)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_LABELS = ("model", "version")


class BareCounter(Metric):
    """A counter family whose samples carry its bare name (`nv_inference_count`, no `_total`), as
    Triton's do; exposition.py declares it under that same name."""

    def __init__(self, name: str, documentation: str):
        super().__init__(name, documentation, "counter")


class Histograms:
    """The histogram families of one server, on its own registry (no global state)."""

    def __init__(self, registry: CollectorRegistry):
        def histogram(name, doc, buckets=_LATENCY_BUCKETS_US):
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=registry)

        self.batch_size = histogram("ferry_batch_size", "Rows per executed batch", _BATCH_BUCKETS)
        self.queue_us = histogram("ferry_queue_duration_us", "Time from enqueue to dispatch, per request")
        self.compute_us = histogram("ferry_compute_duration_us", "Batch compute time (input + infer + output)")
        self.request_us = histogram("ferry_request_duration_us", "End-to-end time in the server, per successful request")


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

    def __init__(self, model: str, version: int, histograms: Histograms | None = None):
        self.model, self.version = model, version
        self.success, self.fail, self.queue = Duration(), Duration(), Duration()
        self.compute_input, self.compute_infer, self.compute_output = Duration(), Duration(), Duration()
        self.cache_hit, self.cache_miss = Duration(), Duration()  # lookups answered / lookups + inserts
        self.cached = False  # the model answers from the server's response cache (its families are shown)
        self.inference_count = self.execution_count = self.last_inference_ms = 0
        self.failures: Counter[str] = Counter()  # by reason: REJECTED, BACKEND, CANCELED
        self.deadline_misses = self.pending = self.window_ns = 0
        self.batch_reruns = 0  # runs spent splitting failed batches (runners/isolation.py)
        self.train_executions = 0  # executes that went to a model process several to a hop (Batch.train)
        self.trains = 0  # those hops: train_executions / trains is the mean train
        self.queued_bytes = 0  # request data held by admitted, unanswered requests (its byte budget's view)
        self.batches: dict[int, BatchTimes] = {}
        self.padded_elements = self.computed_elements = 0  # positions along a variable length
        self.bucket_batches: dict[int, Counter[int]] = {}  # cost bucket -> batch size -> batches
        self.buckets: list[tuple[float, int]] = []  # (upper cost bound, requests waiting) per bucket
        self._lock = threading.Lock()  # the metrics HTTP thread reads while the loop writes
        self._hist = None
        if histograms is not None:
            labels = {"model": model, "version": str(version)}
            self._hist = {name: getattr(histograms, name).labels(**labels)
                          for name in ("batch_size", "queue_us", "compute_us", "request_us")}

    def record_batch(self, rows: int, requests: int, input_ns: int, infer_ns: int, output_ns: int,
                     padded: int = 0, computed: int = 0, bucket: int | None = None, executions: int = 1) -> None:
        """One batch, or a train of `executions` executes of rows / executions rows each (its times the
        train's: each execute is charged an equal share)."""
        size = rows // executions
        with self._lock:
            self.padded_elements += padded
            self.computed_elements += computed
            if bucket is not None:
                self.bucket_batches.setdefault(bucket, Counter())[size] += executions
            self.execution_count += executions
            if executions > 1:
                self.train_executions += executions
                self.trains += 1
            self.inference_count += rows
            times = self.batches.setdefault(size, BatchTimes())
            times.compute_input.add(input_ns, executions)
            times.compute_infer.add(infer_ns, executions)
            times.compute_output.add(output_ns, executions)
            # Triton charges each request of a batch with the batch's compute times (in a train: its execute's).
            self.compute_input.add(input_ns * requests // executions, requests)
            self.compute_infer.add(infer_ns * requests // executions, requests)
            self.compute_output.add(output_ns * requests // executions, requests)
        if self._hist:
            if executions == 1:
                self._hist["batch_size"].observe(rows)
                self._hist["compute_us"].observe((input_ns + infer_ns + output_ns) / 1000)
            else:
                observe_all(self._hist["batch_size"], [size] * executions)
                observe_all(self._hist["compute_us"], [(input_ns + infer_ns + output_ns) / 1000 / executions] * executions)

    def record_queued(self, queue_ns: int) -> None:
        with self._lock:
            self.queue.add(queue_ns)
        if self._hist:
            self._hist["queue_us"].observe(queue_ns / 1000)

    def record_dispatched(self, requests, now_ns: int) -> None:
        """A batch leaves the queue: each request's queue time, and a deadline miss for each that runs late
        (DELAY policy); one lock for the whole batch."""
        waits = [now_ns - r.enqueue_ns for r in requests]
        late = sum(1 for r in requests if r.expired(now_ns))
        with self._lock:
            self.queue.add(sum(waits), len(waits))
            self.deadline_misses += late
        if self._hist:
            observe_all(self._hist["queue_us"], [wait_ns / 1000 for wait_ns in waits])

    def record_done(self, total_ns: int, ok: bool, reason: str = "") -> None:
        with self._lock:
            if ok:
                self.success.add(total_ns)
            else:
                self.fail.add(total_ns)
                self.failures[reason or "OTHER"] += 1
            self.last_inference_ms = int(time.time() * 1000)
        if ok and self._hist:
            self._hist["request_us"].observe(total_ns / 1000)

    def record_successes(self, totals_ns: list[int]) -> None:
        """A batch's requests answered: record_done(ok=True) for all of them, with one lock and one clock read."""
        if not totals_ns:
            return
        with self._lock:
            self.success.add(sum(totals_ns), len(totals_ns))
            self.last_inference_ms = int(time.time() * 1000)
        if self._hist:
            observe_all(self._hist["request_us"], [total_ns / 1000 for total_ns in totals_ns])

    def record_cache_hit(self, lookup_ns: int, total_ns: int) -> None:
        """A request answered from the response cache: a success that neither queued nor ran (Triton
        counts it in success and cache_hit, not in inference or execution counts)."""
        with self._lock:
            self.cache_hit.add(lookup_ns)
            self.success.add(total_ns)
            self.last_inference_ms = int(time.time() * 1000)
        if self._hist:
            self._hist["request_us"].observe(total_ns / 1000)

    def record_cache_miss(self, lookup_and_insert_ns: int) -> None:
        with self._lock:
            self.cache_miss.add(lookup_and_insert_ns)

    def record_deadline_miss(self) -> None:
        with self._lock:
            self.deadline_misses += 1

    def record_reruns(self, runs: int) -> None:
        with self._lock:
            self.batch_reruns += runs

    def set_pending(self, pending: int) -> None:
        """Between turns (an arrival that needs none): only the queue depth moved."""
        self.pending = pending

    def set_gauges(self, gauges) -> None:
        """`gauges`: the scheduler's Gauges record, the one way policy state reaches the metrics."""
        self.pending, self.window_ns = gauges.pending, gauges.window_ns
        if gauges.buckets:
            self.buckets = gauges.buckets  # rebound, never mutated: a scrape reads a whole list

    def snapshot(self) -> dict:
        """A consistent copy, for the statistics RPC and the Prometheus page."""
        with self._lock:
            durations = {k: (d.count, d.ns) for k, d in (
                ("success", self.success), ("fail", self.fail), ("queue", self.queue),
                ("compute_input", self.compute_input), ("compute_infer", self.compute_infer),
                ("compute_output", self.compute_output), ("cache_hit", self.cache_hit),
                ("cache_miss", self.cache_miss))}
            return {
                **durations,
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                "last_inference": self.last_inference_ms, "failures": dict(self.failures),
                "deadline_misses": self.deadline_misses, "pending": self.pending, "window_ns": self.window_ns,
                "batch_reruns": self.batch_reruns, "train_executions": self.train_executions, "trains": self.trains,
                "queued_bytes": self.queued_bytes,
                "padded_elements": self.padded_elements, "computed_elements": self.computed_elements,
                "bucket_batches": {b: dict(sizes) for b, sizes in sorted(self.bucket_batches.items())},
                "buckets": list(self.buckets),
                "batches": {
                    size: {k: (getattr(t, k).count, getattr(t, k).ns) for k in ("compute_input", "compute_infer", "compute_output")}
                    for size, t in sorted(self.batches.items())
                },
            }


def observe_all(histogram, values: list[float]) -> None:
    """Observe a batch's values at once: one increment per bucket touched and one of the sum, where
    observe() takes two locks per value. It reads prometheus_client's histogram child (its bucket bounds
    and values), so where that is not as expected it falls back to observe()."""
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:
        for value in values:
            histogram.observe(value)
        return
    counts: dict[int, int] = {}
    for value in values:
        i = bisect.bisect_left(bounds, value)  # the first bound >= value, as observe() picks it
        counts[i] = counts.get(i, 0) + 1
    total.inc(sum(values))
    for i, count in counts.items():
        buckets[i].inc(count)


# (name, type, help, value from a snapshot); durations in microseconds as Triton reports them
_FAMILIES: list[tuple[str, str, str, Callable[[dict], float]]] = [
    ("nv_inference_request_success", "counter", "Successful inference requests", lambda s: s["success"][0]),
    ("nv_inference_count", "counter", "Inferences performed (batch rows)", lambda s: s["inference_count"]),
    ("nv_inference_exec_count", "counter", "Model executions (batches)", lambda s: s["execution_count"]),
    ("nv_inference_request_duration_us", "counter", "Cumulative end-to-end time of successful requests", lambda s: s["success"][1] / 1000),
    ("nv_inference_queue_duration_us", "counter", "Cumulative queue time", lambda s: s["queue"][1] / 1000),
    ("nv_inference_compute_input_duration_us", "counter", "Cumulative input preparation time", lambda s: s["compute_input"][1] / 1000),
    ("nv_inference_compute_infer_duration_us", "counter", "Cumulative model execution time", lambda s: s["compute_infer"][1] / 1000),
    ("nv_inference_compute_output_duration_us", "counter", "Cumulative output extraction time", lambda s: s["compute_output"][1] / 1000),
    ("nv_inference_pending_request_count", "gauge", "Requests queued, not yet executing", lambda s: s["pending"]),
    ("ferry_queued_bytes", "gauge", "Input data held by admitted requests not yet answered (queued or running)",
     lambda s: s["queued_bytes"]),
    ("ferry_deadline_misses", "counter", "Requests whose deadline passed while queued (rejected or run late)",
     lambda s: s["deadline_misses"]),
    ("ferry_batch_reruns", "counter", "Backend runs spent splitting failed batches until the failing requests ran alone",
     lambda s: s["batch_reruns"]),
    ("ferry_train_executions", "counter", "Executes of a model that does not batch sent to its model process several "
     "to a hop (a train: each request still runs alone)", lambda s: s["train_executions"]),
    ("ferry_trains", "counter", "Trains sent to a model process (ferry_train_executions / ferry_trains: the mean train)",
     lambda s: s["trains"]),
    ("ferry_batch_window_ms", "gauge", "Batching window in force (adaptive or fixed)", lambda s: s["window_ns"] / 1e6),
    ("ferry_padding_elements", "counter", "Positions along a variable length that were padding (rows x padded length - true lengths)",
     lambda s: s["padded_elements"]),
    ("ferry_computed_elements", "counter", "Positions along a variable length computed in batches (rows x padded length)",
     lambda s: s["computed_elements"]),
    ("ferry_padding_waste_ratio", "gauge", "Padding waste: padded / computed positions since start (0 before any)",
     lambda s: s["padded_elements"] / s["computed_elements"] if s["computed_elements"] else 0.0),
]
FAILURE_REASONS = ("REJECTED", "BACKEND", "CANCELED", "OTHER")


def failure_reason(exc: BaseException) -> str:
    """Triton's reason for a request that ended with `exc`: the caller left (its call was cancelled or its
    stream closed), it was refused or ran out of time before it ran, the model failed, or anything else."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELED"
    if isinstance(exc, (QueueFullError, DeadlineExceededError)):
        return "REJECTED"
    return "BACKEND" if isinstance(exc, BackendError) else "OTHER"

# A snapshot's durations that InferStatistics reports, under its field names (the RPC and HTTP share it)
INFER_DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")
# Triton's per-model response cache families, shown for models that use the cache
_CACHE_FAMILIES: list[tuple[str, str, str, Callable[[dict], float]]] = [
    ("nv_cache_num_hits_per_model", "counter", "Requests answered from the response cache", lambda s: s["cache_hit"][0]),
    ("nv_cache_num_misses_per_model", "counter", "Response cache lookups that found nothing", lambda s: s["cache_miss"][0]),
    ("nv_cache_hit_duration_per_model", "counter", "Cumulative time looking up and reading hits, in microseconds",
     lambda s: s["cache_hit"][1] / 1000),
    ("nv_cache_miss_duration_per_model", "counter", "Cumulative time looking up misses and keeping their answers, in "
     "microseconds", lambda s: s["cache_miss"][1] / 1000),
]


class StatsCollector(Collector):
    """Renders every ModelStats on each scrape, and the server's own byte budget."""

    def __init__(self, stats: Callable[[], Iterable[ModelStats]], server_queued_bytes: Callable[[], int] | None = None,
                 loop_busy: Callable[[], float | None] | None = None):
        self._stats = stats
        self._server_queued_bytes = server_queued_bytes
        self._loop_busy = loop_busy

    def collect(self):
        snapshots = [(s, s.snapshot()) for s in self._stats()]
        yield from _model_families(_FAMILIES, snapshots)
        yield from _model_families(_CACHE_FAMILIES, [(s, snap) for s, snap in snapshots if s.cached])
        failure = BareCounter("nv_inference_request_failure", "Failed inference requests, by reason")
        for stats, snap in snapshots:
            for reason in FAILURE_REASONS:
                labels = {"model": stats.model, "version": str(stats.version), "reason": reason}
                failure.add_sample("nv_inference_request_failure", labels, snap["failures"].get(reason, 0))
        yield failure
        yield from _bucket_families(snapshots)
        if self._server_queued_bytes is not None:
            held = Metric("ferry_server_queued_bytes", "Input data held by admitted requests, all models", "gauge")
            held.add_sample("ferry_server_queued_bytes", {}, self._server_queued_bytes())
            yield held
        busy = self._loop_busy() if self._loop_busy is not None else None
        if busy is not None:
            ratio = Metric("ferry_frontend_loop_busy_ratio", "Share of recent time the front end's event loop was busy "
                           "running callbacks (1: it is the bottleneck; adaptive windows then form larger batches)", "gauge")
            ratio.add_sample("ferry_frontend_loop_busy_ratio", {}, busy)
            yield ratio


def _model_families(families, snapshots: list[tuple[ModelStats, dict]]):
    for name, kind, doc, value in families:
        metric = BareCounter(name, doc) if kind == "counter" else Metric(name, doc, kind)
        for stats, snap in snapshots:
            metric.add_sample(name, {"model": stats.model, "version": str(stats.version)}, value(snap))
        yield metric


class CacheCollector(Collector):
    """The server's response cache as a whole (Triton's global cache families)."""

    def __init__(self, cache):
        self._cache = cache

    def collect(self):
        cache = self._cache
        for name, kind, doc, value in (
                ("nv_cache_num_entries", "gauge", "Answers held in the response cache", len(cache)),
                ("nv_cache_num_evictions", "counter", "Answers evicted to make room for newer ones", cache.evictions),
                ("nv_cache_num_hits", "counter", "Lookups answered from the response cache", cache.hits),
                ("nv_cache_num_misses", "counter", "Lookups that found nothing", cache.misses),
                ("nv_cache_util", "gauge", "Share of the response cache's bytes in use", cache.used / cache.capacity)):
            metric = BareCounter(name, doc) if kind == "counter" else Metric(name, doc, kind)
            metric.add_sample(name, {}, value)
            yield metric


class TraceCollector(Collector):
    """OpenTelemetry export (--trace-config mode=opentelemetry): spans delivered, and spans lost to a collector
    that is down or slow (export never blocks a request: what cannot be sent is dropped and counted here)."""

    def __init__(self, exporter):
        self._exporter = exporter

    def collect(self):
        for name, doc, value in (
                ("ferry_trace_spans_exported", "Spans the OTLP collector accepted", self._exporter.exporter.exported),
                ("ferry_trace_spans_dropped", "Spans dropped: the collector refused or could not be reached, or the "
                                              "export queue was full", self._exporter.dropped)):
            metric = BareCounter(name, doc)
            metric.add_sample(name, {}, value)
            yield metric


def _bucket_families(snapshots: list[tuple[ModelStats, dict]]):
    """Per cost bucket (binpack models only): queue depth, upper cost bound, batch sizes."""
    depth = Metric("ferry_bucket_queue_depth", "Requests waiting, per cost bucket", "gauge")
    bound = Metric("ferry_bucket_upper_cost", "Upper cost bound of each bucket in force (+Inf for the last)", "gauge")
    sizes = Metric("ferry_bucket_batch_size", "Rows per executed batch, per cost bucket", "histogram")
    for stats, snap in snapshots:
        model = {"model": stats.model, "version": str(stats.version)}
        for i, (upper, waiting) in enumerate(snap["buckets"]):
            depth.add_sample("ferry_bucket_queue_depth", {**model, "bucket": str(i)}, waiting)
            bound.add_sample("ferry_bucket_upper_cost", {**model, "bucket": str(i)}, upper)
        for bucket, counts in snap["bucket_batches"].items():
            labels = {**model, "bucket": str(bucket)}
            for le in (*_BATCH_BUCKETS, float("inf")):
                below = sum(n for size, n in counts.items() if size <= le)
                sizes.add_sample("ferry_bucket_batch_size_bucket", {**labels, "le": floatToGoString(le)}, below)
            sizes.add_sample("ferry_bucket_batch_size_count", labels, sum(counts.values()))
            sizes.add_sample("ferry_bucket_batch_size_sum", labels, sum(size * n for size, n in counts.items()))
    yield from (depth, bound, sizes)


class FrontDoorRequests:
    """HTTP requests by endpoint (the handler's name, so labels stay few) and status code."""

    def __init__(self, registry: CollectorRegistry):
        from prometheus_client import Counter as PromCounter

        self.http = PromCounter("ferry_http_requests", "HTTP requests answered, by endpoint and status",
                                ("endpoint", "status"), registry=registry)


class ModelProcessRestarts:
    """Python model processes started again after they died (server/backends/python/): by model and version."""

    def __init__(self, registry: CollectorRegistry):
        from prometheus_client import Counter as PromCounter

        self.counter = PromCounter("ferry_model_process_restarts", "Python model processes started again after "
                                   "their process died (crash, kill, os._exit)", _LABELS, registry=registry)

    def restarted(self, model: str, version: int) -> None:
        self.counter.labels(model, str(version)).inc()

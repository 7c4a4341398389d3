"""Generation figures under vLLM's metric names, beside Ferry's own, so dashboards and tools built for vLLM
(its Grafana dashboard, benchmark tools that scrape `/metrics`) read Ferry unchanged.

Names, units (seconds), label (`model_name`) and histogram buckets are those of vLLM's V1 engine
(vllm/v1/metrics/loggers.py). A model's versions share one `model_name` child: counters and histograms
add up over them, gauges show the version that published last (vLLM serves one version per name).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LABELS = ("model_name",)
_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0)
_E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                  480.0, 960.0, 1920.0, 7680.0)
# Ferry's histogram name (generation_metrics.py) -> the vLLM family observing the same interval
LATENCIES = {"ttft_us": "ttft", "itl_us": "itl", "e2e_us": "e2e"}


class VllmFamilies:
    def __init__(self, registry: CollectorRegistry):
        def counter(name, doc):
            return Counter(name, doc, _LABELS, registry=registry)  # exposed with vLLM's `_total` suffix

        def gauge(name, doc):
            return Gauge(name, doc, _LABELS, registry=registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=registry)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS_S)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _ITL_BUCKETS_S)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _E2E_BUCKETS_S)

    def children(self, model: str) -> dict:
        """Each family's child for one model, resolved once (label lookups stay off the token path)."""
        return {name: family.labels(model_name=model) for name, family in vars(self).items()}

"""Generation figures under vLLM's metric names (for vLLM's Grafana dashboard and the benchmark tools that
scrape them), counted from what the OpenAI API answered: token counters equal the usage the client read."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests import llm_builders
from tests.conftest import RunningServer

PROMPTS = ["A ferry crosses the river", "A ferry crosses the river at dawn", "The harbour"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    llm_builders.build_model(repo / "llm" / "1", "llama")
    (repo / "llm" / "config.yaml").write_text(llm_builders.llm_config())
    server = RunningServer(repo)
    try:
        client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)
        usages = []
        for i, prompt in enumerate(PROMPTS):
            done = client.completions.create(model="llm", prompt=prompt, max_tokens=5 + i, temperature=0)
            usages.append((done.usage.prompt_tokens, done.usage.completion_tokens))
        streamed = client.completions.create(model="llm", prompt=PROMPTS[0], max_tokens=9, temperature=0, stream=True,
                                             stream_options={"include_usage": True})
        last = [chunk for chunk in streamed][-1]
        usages.append((last.usage.prompt_tokens, last.usage.completion_tokens))
        server.wait_for_metric("nv_inference_request_success", len(usages), model="llm")
        page = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
        with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10) as reply:  # where vLLM serves it
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            on_http = reply.read().decode()
        yield page, usages, on_http
    finally:
        server.stop()


def samples(page: str) -> dict[tuple[str, tuple], float]:
    found = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            found[s.name, tuple(sorted(s.labels.items()))] = s.value
    return found


def value(page: str, name: str, **labels) -> float:
    return samples(page)[name, tuple(sorted({"model_name": "llm", **labels}.items()))]


def test_token_counters_equal_the_usage_answered(run):
    page, usages, _ = run
    assert value(page, "vllm:prompt_tokens_total") == sum(p for p, _ in usages) > 0
    assert value(page, "vllm:generation_tokens_total") == sum(c for _, c in usages) > 0
    ferry = samples(page)
    assert ferry["ferry_generation_tokens_total", (("model", "llm"), ("version", "1"))] == sum(c for _, c in usages)
    assert ferry["ferry_prompt_tokens_total", (("model", "llm"), ("version", "1"))] == sum(p for p, _ in usages)


def test_latency_histograms_count_each_request_and_token(run):
    page, usages, _ = run
    assert value(page, "vllm:time_to_first_token_seconds_count") == len(usages)
    assert value(page, "vllm:e2e_request_latency_seconds_count") == len(usages)
    assert value(page, "vllm:inter_token_latency_seconds_count") == sum(c - 1 for _, c in usages)
    assert value(page, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == len(usages)
    assert value(page, "vllm:e2e_request_latency_seconds_sum") >= value(page, "vllm:time_to_first_token_seconds_sum") > 0


def test_scheduler_and_cache_gauges(run):
    page, _, _ = run
    assert value(page, "vllm:num_requests_running") == 0 and value(page, "vllm:num_requests_waiting") == 0
    assert 0 <= value(page, "vllm:kv_cache_usage_perc") <= 1
    ferry = samples(page)
    labels = (("model", "llm"), ("version", "1"))
    queries, hits = value(page, "vllm:prefix_cache_queries_total"), value(page, "vllm:prefix_cache_hits_total")
    assert queries == ferry["ferry_prefix_cache_query_tokens_total", labels] > 0
    assert hits == ferry["ferry_prefix_cache_hit_tokens_total", labels] > 0  # the repeated prompt's blocks


def test_vllm_families_are_typed_as_vllm_declares_them(run):
    page, _, _ = run
    families = {f.name: f.type for f in text_string_to_metric_families(page)}
    assert {name: families.get(name) for name in (
        "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")} == dict.fromkeys(
        ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"), "counter")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert families[name] == "gauge", name
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds"):
        assert families[name] == "histogram", name


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) is not installed")
def test_promtool_accepts_the_page(run):
    page, _, _ = run
    done = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True, text=True, timeout=60)
    said = done.stdout + done.stderr
    assert "error" not in said.lower(), said
    # vLLM's own page draws the same note (its names are recording-rule style); nothing else on its families
    notes = [line for line in said.splitlines() if "vllm:" in line and not line.endswith("metric names should not contain ':'")]
    assert notes == [], notes
    assert done.returncode in (0, 3), said  # 3: lint notes only (Triton's names, docs/metrics.md)


def test_the_http_port_serves_the_same_page(run):
    """AIPerf and vLLM-style scrapes read `<url>/metrics` on the API's own port."""
    page, usages, on_http = run
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count"):
        assert value(on_http, name) == value(page, name)
    assert value(on_http, "vllm:generation_tokens_total") == sum(c for _, c in usages)

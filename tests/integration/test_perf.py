"""`ferry perf` against a real server: counts that match the server's own statistics, ordered percentiles,
JSON/CSV/table that agree, a valid PNG; and loadgen's API that bench/ uses."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper

from bench.common import infer_payload
from clients import InferenceClient
from clients.loadgen import closed_loop
from tests import builders
from tests.conftest import ROOT, RunningServer, link_shipped_models

PERCENTILES = ["p50", "p90", "p95", "p99"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple", "classifier", "tiny_llama")
    builders.save_onnx([helper.make_node("Identity", ["x"], ["y"])],  # x [batch, n]: n is variable
                       [builders.tensor("x", TensorProto.FLOAT, ["b", "n"])],
                       [builders.tensor("y", TensorProto.FLOAT, ["b", "n"])], repo / "vary" / "1" / "model.onnx")
    server = RunningServer(repo)
    yield server
    server.stop()


def perf(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", "perf", *args, "--url", server.address], cwd=ROOT,
                          check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"})


def rows_served(server, model: str) -> int:
    with InferenceClient(server.address, timeout_s=30) as client:
        return sum(s.inference_count for s in client.model_statistics(model))


def assert_consistent(point: dict, prefix: str = "latency") -> None:
    assert point["requests"] == point["completed"] + point["errors"]
    values = [point[f"{prefix}_{p}_ms"] for p in PERCENTILES]
    assert values[0] >= 0 and values[-1] > 0 and values == sorted(values), values
    assert point["throughput_rps"] == pytest.approx(point["completed"] / point["duration_s"], rel=1e-2)


def assert_png(path) -> None:
    from matplotlib import image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300 and pixels.std() > 0


def test_closed_loop_sweep_writes_consistent_json_csv_table_and_plot(server, tmp_path):
    before = rows_served(server, "simple")
    done = perf(server, "simple", "--concurrency", "1,4", "--requests", "40", "--warmup", "3", "--progress",
                "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"), "--plot", str(tmp_path / "r.png"))
    assert done.returncode == 0, done.stderr
    assert rows_served(server, "simple") - before == 3 + 2 * 40  # warm-up plus every measured request, batch 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["model"], report["kind"], report["mode"]) == ("simple", "infer", "concurrency")
    assert report["workload"]["inputs"]["INPUT0"] == {"datatype": "FP32", "shape": [1, 16]}
    points = report["points"]
    assert [p["concurrency"] for p in points] == [1, 4]
    for point in points:
        assert point["requests"] == point["completed"] == 40 and point["errors"] == 0
        assert_consistent(point)
    with open(tmp_path / "r.csv") as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == 2
    for line, point in zip(lines, points):
        assert int(line["requests"]) == point["requests"]
        assert float(line["latency_p99_ms"]) == point["latency_p99_ms"]
        assert float(line["throughput_rps"]) == point["throughput_rps"]
    table = done.stdout.splitlines()
    assert table[0].split()[:3] == ["concurrency", "requests", "completed"] and len(table) == 3
    assert table[2].split()[:4] == ["4", "40", "40", "0"]
    assert "c=1 [" in done.stderr and "40/40" in done.stderr and f"wrote {tmp_path / 'r.png'}" in done.stderr
    assert_png(tmp_path / "r.png")


def test_open_loop_with_batched_requests(server):
    before = rows_served(server, "classifier")
    done = perf(server, "classifier", "--request-rate", "100,300", "--requests", "30", "--batch-size", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # --json without a file: the report instead of the table
    assert report["mode"] == "rate" and report["workload"]["inputs"]["features"]["shape"] == [2, 32]
    assert [p["request_rate"] for p in report["points"]] == [100.0, 300.0]
    for point in report["points"]:
        assert point["requests"] == point["completed"] == 30
        assert_consistent(point)
    assert rows_served(server, "classifier") - before == 2 * (4 + 60)  # default warm-up of 4, two rows each


def test_variable_dimensions_come_from_shape_and_duration_bounds_a_level(server):
    refused = perf(server, "vary", "--requests", "5")
    assert refused.returncode == 2 and "give --shape x:" in refused.stderr
    done = perf(server, "vary", "--shape", "x:5", "--concurrency", "2", "--duration", "0.5", "--csv")
    assert done.returncode == 0, done.stderr
    (line,) = list(csv.DictReader(done.stdout.splitlines()))
    assert int(line["requests"]) == int(line["completed"]) > 0 and float(line["duration_s"]) >= 0.5


def test_failed_requests_are_counted_not_timed(server):
    done = perf(server, "simple", "--mode", "generate", "--requests", "5", "--warmup", "0", "--json")
    assert done.returncode == 0, done.stderr
    (point,) = json.loads(done.stdout)["points"]
    assert (point["requests"], point["completed"], point["errors"]) == (5, 0, 5)
    assert point["latency_p50_ms"] is None
    (message,) = point["error_messages"]
    assert message.startswith("INVALID_ARGUMENT") and point["error_messages"][message] == 5


def test_generation_sweep_reports_token_timings(server, tmp_path):
    done = perf(server, "tiny_llama", "--concurrency", "1,3", "--requests", "6", "--max-tokens", "8",
                "--prompt-length", "4:12", "--json", str(tmp_path / "g.json"), "--plot", str(tmp_path / "g.png"))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "g.json").read_text())
    assert report["kind"] == "generate" and report["workload"]["prompt_words"] == [4, 12]
    for point in report["points"]:
        assert point["requests"] == point["completed"] == 6 and point["finish_reasons"] == {"length": 6}
        assert point["output_tokens"] == 6 * 8 and point["prompt_tokens_mean"] > 0
        for prefix in ("latency", "ttft", "tpot", "itl"):
            assert_consistent(point, prefix)
        assert point["ttft_p50_ms"] <= point["latency_p50_ms"]  # every first token precedes its request's end
        assert point["output_tokens_per_s"] == pytest.approx(point["output_tokens"] / point["duration_s"], rel=1e-2)
    assert "ttft_p50_ms" in done.stdout
    assert_png(tmp_path / "g.png")


def test_loadgen_api_used_by_bench_is_unchanged(server):
    payload = infer_payload("simple", {"INPUT0": np.ones((1, 16), np.float32), "INPUT1": np.ones((1, 16), np.float32)})
    result = asyncio.run(closed_loop(server.address, [payload], 2, requests=10, warmup=2))
    assert result.completed == 10 and result.sent == 10 and not result.errors
    assert list(result.summary()) == ["concurrency", "request_rate", "completed", "errors", "throughput_rps",
                                      "p50_ms", "p90_ms", "p95_ms", "p99_ms", "client_cpu_share"]

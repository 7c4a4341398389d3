"""The /metrics page as strict parsers read it: every family declared under its samples' name."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer

# Triton's own names break promtool's naming lints (counters without `_total`, `_us` units, counts
# named `nv_inference_count` that are not histograms), and
# Ferry's names follow Triton's; they are kept for Triton's dashboards. Anything else promtool says
# (a parse error, a family without samples of its type, a duplicate) is a failure.
TRITON_NAMING = ('counter metrics should have "_total" suffix', "should not contain abbreviated units",
                 "use base unit", 'non-histogram and non-summary metrics should not have "_count" suffix')


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    repo = tmp_path_factory.mktemp("repo")
    builders.add_sub(repo / "simple" / "1" / "model.onnx")
    builders.gated_model(repo, "cached", "response_cache: {enable: true}\n")  # the response cache's families too
    server = RunningServer(repo, "--cache-config", "local,size=65536")
    try:
        for _ in range(2):
            kserve.infer(server.channel, "cached", {"X": np.ones((1, 2), np.float32)})
        a = np.ones((2, 4), np.float32)
        request = pb.ModelInferRequest(model_name="simple", inputs=[
            pb.ModelInferRequest.InferInputTensor(name=n, datatype="FP32", shape=[2, 4]) for n in ("INPUT0", "INPUT1")],
            raw_input_contents=[a.tobytes(), a.tobytes()])
        kserve.stub(server.channel).ModelInfer(request, timeout=30)
        server.wait_for_metric("nv_inference_count", 2, model="simple")
        with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return reply.read().decode()
    finally:
        server.stop()


def test_triton_counter_declared_under_its_sample_name(page):
    assert "# TYPE nv_inference_count counter\n" in page
    assert 'nv_inference_count{model="simple",version="1"} 2.0\n' in page
    assert "nv_inference_count_total" not in page


def test_strict_parser_files_every_sample_under_a_typed_family(page):
    families = {f.name: f for f in text_string_to_metric_families(page)}
    untyped = sorted(name for name, f in families.items() if f.type == "unknown")
    assert untyped == []  # a sample outside its declared family would land in an untyped one
    for name in ("nv_inference_count", "nv_inference_exec_count", "nv_inference_request_success",
                 "nv_inference_request_failure", "nv_inference_queue_duration_us"):
        assert families[name].type == "counter" and families[name].samples, name
    count = next(s for s in families["nv_inference_count"].samples if s.labels["model"] == "simple")
    assert count.labels == {"model": "simple", "version": "1"} and count.value == 2
    assert next(s.value for s in families["nv_inference_exec_count"].samples if s.labels["model"] == "simple") == 1
    assert families["nv_inference_pending_request_count"].type == "gauge"
    assert families["ferry_batch_size"].type == "histogram" and families["ferry_batch_size"].samples
    hits = families["nv_cache_num_hits_per_model"]
    assert hits.type == "counter" and [(s.labels["model"], s.value) for s in hits.samples] == [("cached", 1)]
    assert families["nv_cache_num_entries"].type == "gauge" and families["nv_cache_num_entries"].samples[0].value == 1
    assert 0 < families["nv_cache_util"].samples[0].value < 1


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) is not installed")
def test_promtool_finds_no_error(page):
    done = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True, text=True, timeout=60)
    problems = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert "error" not in (done.stdout + done.stderr).lower(), problems
    unexpected = [line for line in problems if not any(known in line for known in TRITON_NAMING)]
    assert unexpected == [] and done.returncode in (0, 3), (done.returncode, problems)  # 3: lint notes only

"""KServe v2 over HTTP: NVIDIA's tritonclient.http, unchanged, against Ferry (binary and JSON tensors,
BYTES, compression, metadata, statistics, load/unload), plus the wire details it does not exercise."""

from __future__ import annotations

import gzip
import importlib.util
import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests import builders
from tests.conftest import RunningServer, link_shipped_models


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple", "tiny_llama")
    builders.save_onnx([helper.make_node("Identity", ["TEXT"], ["TEXT_OUT"])],
                       [builders.tensor("TEXT", TensorProto.STRING, ["batch", 2])],
                       [builders.tensor("TEXT_OUT", TensorProto.STRING, ["batch", 2])], repo / "echo" / "1" / "model.onnx")
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"junk")
    running = RunningServer(repo, "--max-message-bytes", str(1 << 20), "--model-control-mode", "explicit", "--load-model", "*")  # load/unload: explicit control
    yield running
    running.stop()


def call(server, path: str, body: bytes | None = None, headers: dict | None = None, method: str | None = None):
    """(status, headers, body) of one plain HTTP call. Bodies over the limit go through curl, which reads
    the early 413 where urllib fails on the connection the server closes mid-upload (as servers do)."""
    if body is not None and len(body) > 1 << 19:
        return curl(path, server, body, headers or {})
    request = urllib.request.Request(server.http_url + path, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def curl(path: str, server, body: bytes, headers: dict):
    if shutil.which("curl") is None:
        pytest.skip(reason="curl is not installed")
    args = ["curl", "-s", "-X", "POST", "--data-binary", "@-", "-w", "\n%{http_code}", server.http_url + path]
    for key, value in headers.items():
        args += ["-H", f"{key}: {value}"]
    done = subprocess.run(args, input=body, capture_output=True, timeout=60, check=True)
    answer, _, status = done.stdout.rpartition(b"\n")
    return int(status), {}, answer


@pytest.fixture(scope="module")
def triton(server) -> dict:
    if importlib.util.find_spec("tritonclient.http") is None or importlib.util.find_spec("geventhttpclient") is None:
        pytest.skip(reason="tritonclient[http] is not installed (test extra)")
    script = Path(__file__).with_name("tritonclient_http_calls.py")
    done = subprocess.run([sys.executable, str(script), server.http_address], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_health_metadata_and_config(triton):
    assert triton["live"] and triton["ready"] and triton["model_ready"] and not triton["broken_ready"]
    assert {"binary_tensor_data", "statistics", "model_repository"} <= set(triton["extensions"])
    meta = triton["model_metadata"]
    assert meta["platform"] == "onnxruntime_onnx" and meta["versions"] == ["1"]
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [("INPUT0", "FP32", [-1, 16]), ("INPUT1", "FP32", [-1, 16])]
    assert triton["config"]["name"] == "simple" and triton["config"]["input"][0]["data_type"] == "TYPE_FP32"


def test_infer_binary_json_compressed_and_bytes(triton):
    assert triton["binary_ok"] and triton["id"] == "h-1"
    assert triton["json_ok"] and triton["json_output_params"] == [None, None]  # really sent as JSON lists
    assert triton["subset_outputs"] == ["OUTPUT1"]
    assert triton["gzip_ok"] and triton["deflate_ok"]
    assert triton["bytes_ok"] and triton["bytes_json"] == ["ferry", "b\u00e5t"]


def test_errors_reach_tritonclient_with_tritons_statuses(triton):
    assert triton["unknown_model"]["status"] == "404" and "unknown model" in triton["unknown_model"]["message"]
    assert triton["wrong_dtype"]["status"] == "400" and "INPUT0" in triton["wrong_dtype"]["message"]
    assert triton["generation_model"]["status"] == "501" and "/generate" in triton["generation_model"]["message"]


def test_index_statistics_and_model_control(triton):
    states = {m["name"]: m["state"] for m in triton["index"] if m["version"] == "1" or m["name"] == "broken"}
    assert states["simple"] == "READY" and states["echo"] == "READY" and states["broken"] == "UNAVAILABLE"
    stats = triton["stats"]
    # 5 successful requests of 2 rows each (binary, JSON, subset, gzip, deflate), before the statistics call (the failing ones never ran)
    assert stats["inference_stats"]["success"]["count"] == 5 and stats["inference_count"] == 10
    assert not triton["ready_after_unload"] and triton["infer_after_unload"]["status"] in ("404", "503")
    assert triton["ready_after_load"]


def test_mixed_binary_and_json_inputs_and_the_binary_header(server):
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    header = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 64}},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "data": [1] * 16}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    status, headers, body = call(server, "/v2/models/simple/versions/1/infer", header + a.tobytes(),
                                 {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200, body
    length = int(headers["inference-header-content-length"])
    described = json.loads(body[:length])
    assert described["outputs"][0]["parameters"] == {"binary_data_size": 64}
    assert np.frombuffer(body[length:], np.float32).tolist() == (a + 1).reshape(-1).tolist()


@pytest.mark.parametrize("body, headers, status, words", [
    (b"{not json", {}, 400, "not valid JSON"),
    (json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.5] * 15}]}).encode(), {}, 400, "16"),
    (json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": ["x"] * 16}]}).encode(), {}, 400, "string"),
    (json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                             "parameters": {"binary_data_size": 64}}]}).encode(), {}, 400, "binary_data_size"),
    (b"{}", {"Inference-Header-Content-Length": "99"}, 400, "Inference-Header-Content-Length"),
    (b"x" * (1 << 20 | 1), {}, 413, "at most"),
    (gzip.compress(b" " * (2 << 20)), {"Content-Encoding": "gzip"}, 413, "decompresses"),
    (b"{}", {"Content-Encoding": "br"}, 400, "Content-Encoding"),
    (json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": {
        "shared_memory_region": "r", "shared_memory_byte_size": 64}}]}).encode(), {}, 404,
     "Unable to find shared memory region: 'r'"),
    (json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1] * 16}],
                 "outputs": [{"name": "OUTPUT0", "parameters": {"shared_memory_region": "r"}}]}).encode(), {}, 400,
     "'shared_memory_byte_size' must be specified along with 'shared_memory_region' parameter for tensor 'OUTPUT0'"),
], ids=["bad-json", "wrong-count", "strings-for-fp32", "missing-binary", "header-length", "too-large", "gzip-bomb",
        "unknown-encoding", "shm-input", "shm-output"])
def test_bad_requests_get_a_clear_4xx(server, body, headers, status, words):
    got, _, answer = call(server, "/v2/models/simple/infer", body, headers)
    assert got == status and words in json.loads(answer)["error"], answer
    ok, _, _ = call(server, "/v2/health/ready")
    assert ok == 200  # and the server is none the worse

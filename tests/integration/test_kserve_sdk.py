"""KServe's own Python SDK, unchanged, against Ferry: its v2 REST and gRPC clients, its generated v2 stubs and
its v2 data models (run in a subprocess: kserve_sdk_calls.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import builders
from tests.conftest import RunningServer

A = np.arange(8, dtype=np.float32).reshape(2, 4)
B = np.full((2, 4), 0.5, np.float32)


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    builders.add_sub(repo / "simple" / "1" / "model.onnx")
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not onnx")
    server = RunningServer(repo)
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("kserve_sdk_calls.py")), server.http_url,
                               server.address], capture_output=True, text=True, timeout=120)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("client", ["rest_binary", "rest_json", "grpc"])
def test_sdk_clients_health_and_infer(answers, client):
    got = answers[client]
    assert (got["live"], got["ready"], got["model_ready"], got["broken_ready"]) == (True, True, True, False)
    assert got["id"] == "sdk-1"
    np.testing.assert_array_equal(np.array(got["outputs"]["OUTPUT0"], np.float32), A + B)
    np.testing.assert_array_equal(np.array(got["outputs"]["OUTPUT1"], np.float32), A - B)


def test_rest_bodies_are_kserve_data_models(answers):
    got = answers["rest_models"]
    assert got["live"] == {"status": 200, "body": {"live": True}}
    assert got["ready"] == {"status": 200, "body": {"ready": True}}
    assert got["model_ready"] == {"status": 200, "body": {"name": "simple", "ready": True}}
    assert got["broken_ready"] == {"status": 400, "body": {"name": "broken", "ready": False}}  # Triton's status
    assert got["server"]["body"]["name"] == "ferry" and "binary_tensor_data" in got["server"]["body"]["extensions"]
    model = got["model"]["body"]
    assert model["name"] == "simple" and model["versions"] == ["1"] and model["platform"] == "onnxruntime_onnx"
    assert [(t["name"], t["datatype"], t["shape"]) for t in model["inputs"]] == [
        ("INPUT0", "FP32", [-1, 4]), ("INPUT1", "FP32", [-1, 4])]


def test_grpc_metadata_through_kserve_stubs(answers):
    got = answers["grpc_metadata"]
    assert got["name"] == "ferry" and "model_repository" in got["extensions"] and got["unknown"] == "NOT_FOUND"
    assert got["outputs"] == [["OUTPUT0", "FP32", [-1, 4]], ["OUTPUT1", "FP32", [-1, 4]]]

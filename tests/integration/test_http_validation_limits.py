"""Requests Triton's own HTTP tests send to find validation gaps, with raw httpx: each is refused with
Triton's status and words (or Ferry's better status, see docs/unchanged-clients.md), and the server
goes on serving."""

from __future__ import annotations

import json

import grpc
import httpx
import numpy as np
import pytest

from tests import builders, kserve
from tests.conftest import RunningServer

LIMIT = 1 << 20  # --http-max-input-size for this server (Triton: 64 MiB)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    builders.add_sub(repo / "simple" / "1" / "model.onnx")
    builders.identity_all_types(repo / "types" / "1" / "model.onnx")
    running = RunningServer(repo, "--http-max-input-size", str(LIMIT))
    yield running
    running.stop()


def simple_body(**extra) -> dict:
    data = list(range(4))
    return {"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 4], "data": data} for n in ("INPUT0", "INPUT1")], **extra}


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.http_url}{path}", timeout=60, **kwargs)


def assert_still_serving(server):
    answer = post(server, "/v2/models/simple/infer", json=simple_body())
    assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [0.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize("body, status, words", [
    (simple_body(outputs=[{"name": "OUTPUT0"}, {"name": "OUTPUT0"}]), 400, "output 'OUTPUT0' already exists in request"),
    ({"inputs": simple_body()["inputs"][:1]}, 400,
     "expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) ['INPUT0'], but missing required input(s) ['INPUT1']"),
    ({"inputs": [*simple_body()["inputs"], {"name": "EXTRA", "datatype": "FP32", "shape": [1], "data": [1]}]}, 400,
     "unexpected inference input 'EXTRA' for model 'simple'"),
    (simple_body(parameters={"triton_anything": 1}), 400, "parameter keys starting with 'triton_' are reserved for Triton usage"),
    (simple_body(parameters={"triton_enable_empty_final_response": True}), 400, "reserved for Triton usage"),
    ({"inputs": [{"name": "INPUT0", "shape": [2, -5], "datatype": "FP32", "data": [1.0]}]}, 400, "dimension -5"),
    ({"inputs": [{"name": "INPUT0", "shape": [2**4, 2**60 + 2], "datatype": "FP32", "data": [1.0]}]}, 400, "dimension"),
])
def test_bad_infer_bodies_are_refused(server, body, status, words):
    answer = post(server, "/v2/models/simple/infer", json=body)
    assert answer.status_code == status and words in answer.json()["error"], answer.text
    assert_still_serving(server)


def test_a_repository_index_body_nested_250000_deep_is_a_client_error(server):
    depth = 250_000
    answer = post(server, "/v2/repository/index", content='{"ready":' + "[" * depth + "true" + "]" * depth + "}")
    assert answer.status_code == 400 and "nesting depth" in answer.json()["error"], answer.text
    wrong = post(server, "/v2/repository/index", json={"ready": [True]})
    assert wrong.status_code == 400 and "Invalid value for 'ready': expected a boolean" in wrong.json()["error"]
    assert httpx.get(f"{server.http_url}/v2/health/live").status_code == 200


def test_the_http_input_limit_holds_the_body(server):
    body = json.dumps(simple_body()).encode() + b" " * LIMIT
    answer = post(server, "/v2/models/simple/infer", content=body)
    assert answer.status_code == 413, answer.text
    assert "exceeds the maximum allowed input size of 1048576 bytes" in answer.json()["error"]
    assert_still_serving(server)


def test_json_data_is_counted_as_the_tensor_it_decodes_to(server):
    """Under the limit as JSON ("0," is 2 bytes), over it as INT64 (8 bytes an element)."""
    count = LIMIT // 6
    names = ["INT32", "INT64"]
    body = {"inputs": [{"name": f"IN_{t}", "datatype": t, "shape": [1, count], "data": [0] * count} for t in names]}
    others = [t for t in builders.ONNX_TYPES if t not in names]
    for t in others:  # the model's other inputs: one element each
        value = "a" if t == "BYTES" else (False if t == "BOOL" else 0)
        body["inputs"].append({"name": f"IN_{t}", "datatype": t, "shape": [1, 1], "data": [value]})
    raw = json.dumps(body, separators=(",", ":")).encode()
    assert len(raw) < LIMIT
    answer = post(server, "/v2/models/types/infer", content=raw)
    assert answer.status_code == 413 and "exceeds the maximum allowed input size" in answer.json()["error"], answer.text
    small = json.loads(json.dumps(body))
    for tensor in small["inputs"][:2]:
        tensor["shape"], tensor["data"] = [1, 2], [0, 1]
    answer = post(server, "/v2/models/types/infer", json=small)
    assert answer.status_code == 200, answer.text
    assert {o["name"]: o["data"] for o in answer.json()["outputs"]}["OUT_INT64"] == [0, 1]


def test_an_out_of_range_inference_header_length_is_a_client_error(server):
    answer = post(server, "/v2/models/simple/infer", json={"inputs": []}, headers={"Inference-Header-Content-Length": "99999999999"})
    assert answer.status_code == 400, answer.text
    assert_still_serving(server)


def test_duplicate_output_names_are_refused_over_grpc_too(server):
    request = kserve.request("simple", {"INPUT0": np.zeros((1, 4), np.float32), "INPUT1": np.zeros((1, 4), np.float32)},
                             outputs=["OUTPUT1", "OUTPUT1"])
    with pytest.raises(grpc.RpcError) as info:
        kserve.stub(server.channel).ModelInfer(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "output 'OUTPUT1' already exists in request" in info.value.details()


def test_a_tensor_whose_bytes_do_not_fill_its_shape_is_refused_in_tritons_words(server):
    header = json.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 8}}
                                    for n in ("INPUT0", "INPUT1")]}).encode()
    answer = post(server, "/v2/models/simple/infer", content=header + bytes(16),
                  headers={"Inference-Header-Content-Length": str(len(header))})
    assert answer.status_code == 400, answer.text
    assert "input byte size mismatch for input 'INPUT0' for model 'simple'. Expected 16, got 8" in answer.json()["error"]
    request = kserve.request("simple", {"INPUT0": np.zeros((1, 4), np.float32), "INPUT1": np.zeros((1, 4), np.float32)})
    request.raw_input_contents[1] = bytes(12)
    with pytest.raises(grpc.RpcError) as info:
        kserve.stub(server.channel).ModelInfer(request, timeout=60)
    assert "input byte size mismatch for input 'INPUT1' for model 'simple'. Expected 16, got 12" in info.value.details()


@pytest.mark.parametrize("depth, ok", [(50, True), (120, False)])
def test_json_data_nested_past_tritons_limit_is_refused(server, depth, ok):
    def nested(value):
        for _ in range(depth):
            value = [value]
        return value

    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 4], "data": nested([1, 2, 3, 4])}
                       for n in ("INPUT0", "INPUT1")]}
    answer = post(server, "/v2/models/simple/infer", json=body)
    if ok:
        assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0], answer.text
    else:
        assert answer.status_code == 400 and "JSON nesting depth exceeds maximum allowed limit (100)" in answer.json()["error"]

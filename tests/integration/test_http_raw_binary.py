"""Triton's HTTP body forms, sent with raw httpx: the raw binary request (`Inference-Header-Content-Length:
0`, the whole body one input's bytes, every output answered in binary), chunked transfer encoding, and
the 503 a full queue answers."""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pytest

from tests import builders, model_kinds
from tests.conftest import RunningServer, wait_for

ECHO_BYTES = '''
import numpy as np


class Model:
    def execute(self, inputs):
        text = inputs["TEXT"]
        out = np.array([v.upper() for v in text.reshape(-1)], dtype=object).reshape(text.shape)
        return {"UPPER": out, "LENGTH": np.array([len(text.reshape(-1)[0])], np.int32)}
'''

ECHO_CONFIG = """
backend: python
max_batch_size: 0
input: [{name: TEXT, data_type: TYPE_STRING, dims: [1]}]
output: [{name: UPPER, data_type: TYPE_STRING, dims: [1]}, {name: LENGTH, data_type: TYPE_INT32, dims: [1]}]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    builders.double(repo)
    builders.add_sub(repo / "simple" / "1" / "model.onnx")
    model_kinds.python_model(repo, "echo", ECHO_BYTES, ECHO_CONFIG)
    running = RunningServer(repo)
    yield running
    running.stop()


def split(response: httpx.Response) -> tuple[dict, bytes]:
    length = int(response.headers["inference-header-content-length"])
    return json.loads(response.content[:length]), response.content[length:]


def test_a_raw_body_is_the_single_input_and_outputs_come_back_binary(server):
    x = np.array([1.5, -2, 4], np.float32)
    response = httpx.post(f"{server.http_url}/v2/models/onnx_b/infer", content=x.tobytes(), timeout=60,
                          headers={"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    header, tail = split(response)
    (out,) = header["outputs"]
    assert out["name"] == "Y" and out["shape"] == [1, 3] and out["parameters"] == {"binary_data_size": 12}
    np.testing.assert_allclose(np.frombuffer(tail, np.float32), x * 2)


def test_a_raw_body_for_a_bytes_input_is_its_one_element(server):
    response = httpx.post(f"{server.http_url}/v2/models/echo/infer", content=b"ferry \x00 boat", timeout=60,
                          headers={"Inference-Header-Content-Length": "0"})
    assert response.status_code == 200, response.text
    header, tail = split(response)
    sizes = {o["name"]: o["parameters"]["binary_data_size"] for o in header["outputs"]}
    upper = tail[:sizes["UPPER"]]
    assert upper[4:] == b"FERRY \x00 BOAT"  # BYTES on the wire: a 4-byte length, then the element
    assert np.frombuffer(tail[sizes["UPPER"]:], np.int32).tolist() == [len(b"ferry \x00 boat")]


def test_an_empty_raw_body_is_a_zero_size_tensor(server):
    response = httpx.post(f"{server.http_url}/v2/models/onnx_b/infer", content=b"", timeout=60,
                          headers={"Inference-Header-Content-Length": "0"})
    assert response.status_code == 200, response.text
    header, tail = split(response)
    assert header["outputs"][0]["shape"] == [1, 0] and tail == b""


@pytest.mark.parametrize("model, body, words", [
    ("simple", b"\0" * 32, "Raw request must only have 1 input"),
    ("onnx_b", b"\0" * 7, "not a whole number of FP32 elements"),
])
def test_a_raw_body_the_model_cannot_take_is_refused(server, model, body, words):
    response = httpx.post(f"{server.http_url}/v2/models/{model}/infer", content=body, timeout=60,
                          headers={"Inference-Header-Content-Length": "0"})
    assert response.status_code == 400 and words in response.json()["error"], response.text


def chunks(data: bytes, size: int = 5):
    for start in range(0, len(data), size):
        yield data[start:start + size]


def test_a_chunked_body_is_read_whole(server):
    a, b = np.arange(4, dtype=np.float32).reshape(1, 4), np.ones((1, 4), np.float32)
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": a.ravel().tolist()},
                                    {"name": "INPUT1", "datatype": "FP32", "shape": [1, 4],
                                     "parameters": {"binary_data_size": 16}}]}).encode()
    response = httpx.post(f"{server.http_url}/v2/models/simple/infer", content=chunks(header + b.tobytes()), timeout=60,
                          headers={"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o["data"] for o in response.json()["outputs"]}
    assert outputs["OUTPUT0"] == (a + b).ravel().tolist() and outputs["OUTPUT1"] == (a - b).ravel().tolist()
    raw = httpx.post(f"{server.http_url}/v2/models/onnx_b/infer", content=chunks(np.ones(6, np.float32).tobytes()),
                     headers={"Inference-Header-Content-Length": "0"}, timeout=60)
    assert raw.status_code == 200 and split(raw)[0]["outputs"][0]["shape"] == [1, 6], raw.text


def test_a_full_queue_answers_503(tmp_path):
    gate = tmp_path / "gate"
    builders.gated_model(tmp_path, "held", "dynamic_batching: {default_queue_policy: {max_queue_size: 1}}\n"
                         "instance_group: [{count: 1, kind: KIND_CPU}]\n", gate=gate, max_batch_size=1)
    server = RunningServer(tmp_path)
    url = f"{server.http_url}/v2/models/held/infer"
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2], "data": [-1, -2]}]}
    answers = []
    try:
        callers = [threading.Thread(target=lambda: answers.append(httpx.post(url, json=body, timeout=120)))]
        callers[0].start()
        wait_for(lambda: (tmp_path / "gate.running").exists(), what="the first request to hold at the gate")
        callers.append(threading.Thread(target=lambda: answers.append(httpx.post(url, json=body, timeout=120))))
        callers[1].start()
        server.wait_for_metric("nv_inference_pending_request_count", 1, timeout_s=60, model="held")
        full = httpx.post(url, json=body, timeout=60)
        assert full.status_code == 503 and "max_queue_size 1" in full.json()["error"], full.text
        gate.touch()
        for caller in callers:
            caller.join(120)
        assert [a.status_code for a in answers] == [200, 200]  # the full queue failed no one else
    finally:
        gate.touch()
        server.stop()

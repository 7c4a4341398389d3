"""Triton's generate endpoint for a model that takes tensors (a decoupled Python model written to Triton's
Python API), as Triton's own generate endpoint tests send it, with raw httpx: keys that are not inputs
are request parameters, `id` is echoed, repeated keys and wrong JSON types are refused in Triton's words,
and a failure once the stream runs is an `error` event of a 200 stream."""

from __future__ import annotations

import json

import httpx
import pytest

from tests import model_kinds
from tests.conftest import RunningServer

# ECHO: TEXT = PROMPT, sent `times` times (a request parameter, default 1); `fail_last` ends with an error.
ECHO = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            params = json.loads(request.parameters())
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
            keys = np.array([",".join(sorted(params)).encode()], np.object_)
            for _ in range(params.get("times", 1)):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("TEXT", prompt), pb_utils.Tensor("KEYS", keys)]))
            final = pb_utils.InferenceResponse(error=pb_utils.TritonError("the echo failed")) if params.get("fail_last") else None
            sender.send(final, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

ECHO_CONFIG = """
backend: python
max_batch_size: 0
model_transaction_policy: {decoupled: true}
input:
  - {name: PROMPT, data_type: TYPE_STRING, dims: [1, 1]}
  - {name: LOUD, data_type: TYPE_BOOL, dims: [1, 1]}
  - {name: ids, data_type: TYPE_INT32, dims: [1, -1], optional: true}
output:
  - {name: TEXT, data_type: TYPE_STRING, dims: [1, -1]}
  - {name: KEYS, data_type: TYPE_STRING, dims: [1]}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    model_kinds.python_model(repo, "echo", ECHO, ECHO_CONFIG)
    running = RunningServer(repo)
    yield running
    running.stop()


def post(server, route: str, body) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.http_url}/v2/models/echo/{route}", content=content, timeout=60)


def events(response: httpx.Response) -> list[dict]:
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


def test_keys_that_are_not_inputs_are_request_parameters_and_the_id_is_echoed(server):
    answer = post(server, "generate", {"id": "42", "PROMPT": "hello", "LOUD": False, "temperature": 0.5,
                                       "parameters": {"stream": True}, "ids": [1, 2]})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"id": "42", "model_name": "echo", "model_version": "1", "TEXT": "hello",
                             "KEYS": "stream,temperature"}
    assert "id" not in post(server, "generate", {"PROMPT": "a", "LOUD": True, "id": ""}).json()


def test_generate_stream_sends_each_response_and_parameters_inside_parameters_count(server):
    response = post(server, "generate_stream", {"PROMPT": ["hi"], "LOUD": False, "parameters": {"times": 3}})
    assert response.status_code == 200, response.text
    assert [e["TEXT"] for e in events(response)] == ["hi"] * 3


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
@pytest.mark.parametrize("body, words", [
    ({"PROMPT": 123, "LOUD": False}, "attempt to access JSON non-string as string"),
    ({"PROMPT": "a", "LOUD": "false"}, "attempt to access JSON non-boolean as boolean"),
    ({"LOUD": 1, "PROMPT": True}, "attempt to access JSON non-boolean as boolean"),  # in document order
    ('{"PROMPT": "a", "LOUD": false, "PROMPT": "again"}', "input 'PROMPT' already exists in request"),
    ({"PROMPT": "a"}, "expected number of inputs between 2 and 3 but got 1"),
    ({"PROMPT": "a", "LOUD": True, "nested": {"x": 1}}, "parameter 'nested' has invalid type"),
    ({"PROMPT": "a", "LOUD": True, "parameters": 1}, "Expected JSON object for keyword: 'parameters'"),
    ({"PROMPT": "a", "LOUD": True, "parameters": {"n": {"x": 1}}},
     "Converting keyword: 'parameters': parameter 'n' has invalid type."),
])
def test_bad_bodies_are_refused_as_triton_refuses_them(server, route, body, words):
    response = post(server, route, body)
    assert response.status_code == 400 and response.headers["content-type"] == "application/json", response.text
    assert words in response.json()["error"], response.text


def test_generate_needs_exactly_one_response(server):
    for times in (0, 2):
        response = post(server, "generate", {"PROMPT": "a", "LOUD": True, "times": times})
        assert response.status_code == 400 and "exactly 1 response" in response.json()["error"], response.text


def test_a_failure_once_the_stream_runs_is_an_error_event(server):
    for times, expected in ((0, [{"error": "the echo failed"}]), (1, ["hi", {"error": "the echo failed"}])):
        response = post(server, "generate_stream", {"PROMPT": "hi", "LOUD": True, "times": times, "fail_last": True})
        assert response.status_code == 200, response.text
        got = [e if "error" in e else e["TEXT"] for e in events(response)]
        assert got == expected

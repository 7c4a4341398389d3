"""Request parameters reach every step of an ensemble and the models a BLS model calls, and headers
matching --grpc-header-forward-pattern / --http-header-forward-pattern become request parameters, as in
Triton; through tritonclient gRPC and HTTP (in a subprocess: its protobuf messages clash with Ferry's)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import model_kinds
from tests.conftest import RunningServer

if importlib.util.find_spec("tritonclient") is None:
    pytest.skip(reason="tritonclient is not installed (it is part of the test extra)", allow_module_level=True)

SCRIPT = Path(__file__).with_name("parameters_calls.py")

# SEEN: the request's parameters as JSON text; Y = X.
ECHO = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            seen = np.array([request.parameters().encode()], np.object_)
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", seen), pb_utils.Tensor("Y", x)]))
        return out
'''
ECHO_CONFIG = """
backend: python
max_batch_size: 0
input: [{name: X, data_type: TYPE_FP32, dims: [1]}]
output: [{name: SEEN, data_type: TYPE_STRING, dims: [1]}, {name: Y, data_type: TYPE_FP32, dims: [1]}]
"""

# BLS: calls echo with its own request's parameters, answering what echo saw.
BLS = '''
import json
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            called = pb_utils.InferenceRequest(model_name="echo", inputs=[pb_utils.get_input_tensor_by_name(request, "X")],
                                               requested_output_names=["SEEN"],
                                               parameters=json.loads(request.parameters())).exec()
            if called.has_error():
                raise pb_utils.TritonModelException(called.error().message())
            out.append(pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(called, "SEEN")]))
        return out
'''
BLS_CONFIG = ECHO_CONFIG.replace(", {name: Y, data_type: TYPE_FP32, dims: [1]}", "")

PAIR = """
platform: "ensemble"
max_batch_size: 0
input [{name: "X", data_type: TYPE_FP32, dims: [1]}]
output [{name: "FIRST", data_type: TYPE_STRING, dims: [1]}, {name: "SECOND", data_type: TYPE_STRING, dims: [1]}]
ensemble_scheduling { step [
  {model_name: "echo", input_map: {key: "X", value: "X"}, output_map: [{key: "SEEN", value: "FIRST"}, {key: "Y", value: "y"}]},
  {model_name: "echo_too", input_map: {key: "X", value: "y"}, output_map: {key: "SEEN", value: "SECOND"}}
] }
"""


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("repo")
    model_kinds.python_model(repo, "echo", ECHO, ECHO_CONFIG)
    model_kinds.python_model(repo, "echo_too", ECHO, ECHO_CONFIG)
    model_kinds.python_model(repo, "bls", BLS, BLS_CONFIG)
    (repo / "pair" / "1").mkdir(parents=True)
    (repo / "pair" / "config.pbtxt").write_text(PAIR)
    server = RunningServer(repo, "--grpc-header-forward-pattern", "^FWD-|^triton_|^priority$",
                           "--http-header-forward-pattern", "^fwd-|^triton_|^priority$")
    try:
        done = subprocess.run([sys.executable, str(SCRIPT), server.address, server.http_address],
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)
    finally:
        server.stop()


PARAMS = {"color": "blue", "count": 3, "on": True}


@pytest.mark.parametrize("door", ["grpc", "http"])
def test_parameters_and_forwarded_headers_reach_the_model(found, door):
    seen = found[door]["echo"]["SEEN"]
    assert {k: seen[k] for k in PARAMS} == PARAMS
    assert seen["fwd-trace"].rstrip() == "abc" and "other" not in seen  # only names the pattern matches (any case)


@pytest.mark.parametrize("door", ["grpc", "http"])
def test_parameters_reach_every_ensemble_step(found, door):
    pair = found[door]["pair"]
    for step in ("FIRST", "SECOND"):
        assert {k: pair[step][k] for k in PARAMS} == PARAMS, pair
        assert "fwd-trace" in pair[step]


@pytest.mark.parametrize("door", ["grpc", "http"])
def test_a_bls_call_carries_the_parameters_it_is_given(found, door):
    assert {k: found[door]["bls"]["SEEN"][k] for k in PARAMS} == PARAMS


@pytest.mark.parametrize("door", ["grpc", "http"])
def test_a_forwarded_header_with_a_reserved_name_is_refused(found, door):
    for name, answer in found[door]["reserved"].items():
        assert f"Header '{name}' is reserved for Triton usage and cannot be forwarded." in answer["error"], answer


@pytest.mark.parametrize("flags, words", [
    (["--grpc-header-forward-pattern", "("], "is not a valid regular expression"),
    (["--http-header-forward-pattern", "[x"], "is not a valid regular expression"),
    (["--grpc-header-forward-pattern", "^x", "--frontend-processes", "2"], "served by the one-process gRPC door only"),
    (["--http-max-input-size", "0"], "--http-max-input-size must be a positive number of bytes"),
])
def test_bad_request_flags_are_refused_before_serving(flags, words):
    done = subprocess.run([sys.executable, "-m", "server", "serve", "--model-repository", ".", *flags],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2 and words in done.stderr, done.stderr

"""Level TENSORS (`--trace-config level=TENSORS`): each traced request's inputs as they entered its model's
queue and its outputs as the model answered them, in Triton's entries (`TENSOR_QUEUE_INPUT`,
`TENSOR_BACKEND_OUTPUT`, data as comma-separated text, as qa/common/trace_summary.py reads it), for an
infer over each door and for an ensemble and each of its steps; every step trace has Triton's full set of
timestamps, and the ensemble's own has QUEUE_START and INFER_RESPONSE_COMPLETE; a BLS call's child trace
carries its tensors as a step's does."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import numpy as np
import pytest

from tests import kserve
from tests.conftest import RunningServer, link_shipped_models

# A Triton-API Python model that answers with simple's sum, asked through one BLS call in the caller's trace.
BLS = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = [pb_utils.get_input_tensor_by_name(request, n) for n in ("INPUT0", "INPUT1")]
            summed = pb_utils.InferenceRequest(model_name="simple", inputs=inputs, requested_output_names=["OUTPUT0"],
                                               trace=request.trace()).exec()
            responses.append(pb_utils.InferenceResponse(summed.output_tensors()))
        return responses
"""
BLS_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 1, 16 ] }, { name: "INPUT1", data_type: TYPE_FP32, dims: [ 1, 16 ] }]
output [{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1, 16 ] }]
"""
STEP_STAMPS = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
               "COMPUTE_END", "INFER_RESPONSE_COMPLETE", "REQUEST_END"]
A = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
B = np.random.default_rng(2).standard_normal((1, 16)).astype(np.float32)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple", "pipeline", "preprocess", "postprocess")
    (repo / "caller" / "1").mkdir(parents=True)
    (repo / "caller" / "1" / "model.py").write_text(BLS)
    (repo / "caller" / "config.pbtxt").write_text(BLS_CONFIG)
    path = tmp_path_factory.mktemp("traces") / "trace.json"
    server = RunningServer(repo, "--trace-config", f"triton,file={path}", "--trace-config", "level=TIMESTAMPS",
                           "--trace-config", "level=TENSORS", "--trace-config", "rate=1")
    seen = {}
    try:
        seen["grpc"] = kserve.infer(server.channel, "simple", {"INPUT0": A, "INPUT1": B}, request_id="grpc-t")
        body = {"id": "ens-t", "inputs": [{"name": "RAW", "shape": [1, 16], "datatype": "FP32", "data": A.ravel().tolist()}]}
        answer = httpx.post(f"{server.http_url}/v2/models/pipeline/infer", json=body, timeout=60).json()
        seen["ensemble"] = np.array(answer["outputs"][0]["data"], np.float32).reshape(1, 16)
        seen["bls"] = kserve.infer(server.channel, "caller", {"INPUT0": A, "INPUT1": B}, request_id="bls-t")
    finally:
        assert server.stop() == 0
    traces: dict[int, dict] = defaultdict(lambda: {"header": None, "stamps": {}, "tensors": {}})
    for entry in json.loads(path.read_text()):
        trace = traces[entry["id"]]
        if "model_name" in entry:
            trace["header"] = entry
        elif "timestamps" in entry:
            trace["stamps"][entry["timestamps"][0]["name"]] = entry["timestamps"][0]["ns"]
        else:
            assert set(entry) == {"id", "activity", "tensor"} and set(entry["tensor"]) == {"name", "data", "shape", "dtype"}
            trace["tensors"][entry["activity"], entry["tensor"]["name"]] = as_array(entry["tensor"])
    seen["traces"] = list(traces.values())
    return seen


def as_array(tensor: dict) -> np.ndarray:
    """Read back as trace_summary.py's get_numpy_array does: floats from the text, then the shape."""
    assert tensor["dtype"] == "FP32"
    return np.array([float(v) for v in tensor["data"].split(",")], np.float32).reshape(
        [int(d) for d in tensor["shape"].split(",")])


def by_request(run, request_id: str) -> dict[str, dict]:
    return {t["header"]["model_name"]: t for t in run["traces"] if t["header"]["request_id"] == request_id}


def test_infer_carries_the_inputs_sent_and_outputs_returned(run):
    trace = by_request(run, "grpc-t")["simple"]
    tensors = trace["tensors"]
    assert set(tensors) == {("TENSOR_QUEUE_INPUT", "INPUT0"), ("TENSOR_QUEUE_INPUT", "INPUT1"),
                            ("TENSOR_BACKEND_OUTPUT", "OUTPUT0"), ("TENSOR_BACKEND_OUTPUT", "OUTPUT1")}
    np.testing.assert_array_equal(tensors["TENSOR_QUEUE_INPUT", "INPUT0"], A)  # repr round-trips float32 exactly
    np.testing.assert_array_equal(tensors["TENSOR_QUEUE_INPUT", "INPUT1"], B)
    np.testing.assert_array_equal(tensors["TENSOR_BACKEND_OUTPUT", "OUTPUT0"], run["grpc"]["OUTPUT0"])
    np.testing.assert_array_equal(tensors["TENSOR_BACKEND_OUTPUT", "OUTPUT1"], run["grpc"]["OUTPUT1"])
    assert [n for n in STEP_STAMPS if n not in trace["stamps"]] == []


def test_ensemble_and_each_step_carry_their_tensors(run):
    traces = by_request(run, "ens-t")
    assert set(traces) == {"pipeline", "preprocess", "simple", "postprocess"}
    ensemble, pre, simple, post = (traces[n]["tensors"] for n in ("pipeline", "preprocess", "simple", "postprocess"))
    np.testing.assert_array_equal(ensemble["TENSOR_QUEUE_INPUT", "RAW"], A)
    np.testing.assert_array_equal(ensemble["TENSOR_BACKEND_OUTPUT", "RESULT"], run["ensemble"])
    np.testing.assert_array_equal(pre["TENSOR_QUEUE_INPUT", "RAW"], A)
    # the data flow: each step's inputs are the tensors the step before it answered (the config's maps)
    np.testing.assert_array_equal(simple["TENSOR_QUEUE_INPUT", "INPUT0"], pre["TENSOR_BACKEND_OUTPUT", "DOUBLED"])
    np.testing.assert_array_equal(simple["TENSOR_QUEUE_INPUT", "INPUT1"], pre["TENSOR_BACKEND_OUTPUT", "SHIFTED"])
    np.testing.assert_array_equal(post["TENSOR_QUEUE_INPUT", "SUM"], simple["TENSOR_BACKEND_OUTPUT", "OUTPUT0"])
    np.testing.assert_array_equal(post["TENSOR_QUEUE_INPUT", "DIFF"], simple["TENSOR_BACKEND_OUTPUT", "OUTPUT1"])
    np.testing.assert_array_equal(post["TENSOR_BACKEND_OUTPUT", "RESULT"], run["ensemble"])
    np.testing.assert_allclose(pre["TENSOR_BACKEND_OUTPUT", "DOUBLED"], A * 2)


def test_every_step_trace_has_tritons_full_timestamp_set(run):
    traces = by_request(run, "ens-t")
    parent = traces.pop("pipeline")
    for name, trace in traces.items():
        assert trace["header"]["parent_id"] == parent["header"]["id"]
        missing = [n for n in STEP_STAMPS if n not in trace["stamps"]]
        assert missing == [], (name, trace["stamps"])
        times = [trace["stamps"][n] for n in STEP_STAMPS]
        assert times == sorted(times), (name, trace["stamps"])
    order = ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START", "INFER_RESPONSE_COMPLETE",
             "REQUEST_END", "HTTP_SEND_START", "HTTP_SEND_END"]
    assert [n for n in order if n not in parent["stamps"]] == [], parent["stamps"]
    assert [parent["stamps"][n] for n in order] == sorted(parent["stamps"][n] for n in order)


def test_a_bls_call_carries_its_tensors(run):
    traces = by_request(run, "bls-t")
    caller, called = traces["caller"], traces["simple"]
    assert called["header"]["parent_id"] == caller["header"]["id"]
    np.testing.assert_array_equal(called["tensors"]["TENSOR_QUEUE_INPUT", "INPUT0"], A)
    np.testing.assert_array_equal(called["tensors"]["TENSOR_QUEUE_INPUT", "INPUT1"], B)
    np.testing.assert_array_equal(called["tensors"]["TENSOR_BACKEND_OUTPUT", "OUTPUT0"], run["bls"]["OUTPUT0"])
    np.testing.assert_array_equal(caller["tensors"]["TENSOR_BACKEND_OUTPUT", "OUTPUT0"], run["bls"]["OUTPUT0"])

"""BLS calls traced as Triton traces them: each call a child trace of the request whose execute made it.

One server traces every request into a file. A Triton-API Python model makes three BLS calls per
request: `exec()` to `simple` (with `trace=request.trace()` and a request id of its own), `exec(
decoupled=True)` to the decoupled `repeat_int32` (no `trace=`: the execute's traced request parents
it) and a streamed generation from `tiny_llama`. A second model calls the first through BLS, so its
calls are grandchildren; a third runs the same code with tracing turned off for it (its BLS calls are
traced nowhere); a decoupled model called over ModelStreamInfer makes one call from its stream. Once the server has stopped cleanly the file is parsed as test_tracing.py parses it:
Triton's layout, `parent_id` links, the called models' names and versions, timestamps in order and
within the caller's request. OpenTelemetry's child spans are checked in test_tracing_otel.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import kserve
from tests.conftest import RunningServer, link_shipped_models
from tests.integration.test_tracing import GRPC_ORDER, STEP_ORDER, assert_ordered, read_traces

httpclient = pytest.importorskip("tritonclient.http")

GEN_TOKENS = 4
REPEATS = [7, 8, 9]
X = np.arange(16, dtype=np.float32).reshape(1, 16)

# Three BLS calls per request; OUTPUT0 is simple's sum, PIECES the generation's streamed responses.
BLS = f'''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


def repeat_inputs():
    return [pb_utils.Tensor("IN", np.array({REPEATS}, np.int32)), pb_utils.Tensor("DELAY", np.zeros(3, np.uint32)),
            pb_utils.Tensor("WAIT", np.zeros(1, np.uint32))]


def generation_inputs():
    sampling = json.dumps({{"temperature": 0, "max_tokens": {GEN_TOKENS}, "ignore_eos": True}})
    return [pb_utils.Tensor("text_input", np.array([b"A ferry leaves"], np.object_)),
            pb_utils.Tensor("stream", np.array([True], np.bool_)),
            pb_utils.Tensor("sampling_parameters", np.array([sampling.encode()], np.object_))]


def answered(response):
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    return response


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = [pb_utils.get_input_tensor_by_name(request, n) for n in ("INPUT0", "INPUT1")]
            summed = answered(pb_utils.InferenceRequest(
                model_name="simple", inputs=inputs, requested_output_names=["OUTPUT0"],
                request_id=request.request_id() + "-simple", trace=request.trace()).exec())
            repeated = [answered(r) for r in pb_utils.InferenceRequest(
                model_name="repeat_int32", inputs=repeat_inputs(), requested_output_names=["OUT"]).exec(decoupled=True)]
            pieces = [answered(r) for r in pb_utils.InferenceRequest(
                model_name="tiny_llama", inputs=generation_inputs(), requested_output_names=["text_output"]).exec(decoupled=True)]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.get_output_tensor_by_name(summed, "OUTPUT0"),
                pb_utils.Tensor("REPEATS", np.array([len(repeated) - 1], np.int32)),
                pb_utils.Tensor("PIECES", np.array([len(pieces) - 1], np.int32))]))
        return responses
'''
# Calls the model above through BLS with its own request's trace: the calls that one makes are grandchildren.
OUTER = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            called = pb_utils.InferenceRequest(model_name="tbls", inputs=request.inputs(),
                                               requested_output_names=["OUTPUT0", "REPEATS", "PIECES"],
                                               request_id=request.request_id(), trace=request.trace()).exec()
            if called.has_error():
                raise pb_utils.TritonModelException(called.error().message())
            responses.append(pb_utils.InferenceResponse(called.output_tensors()))
        return responses
'''
# Decoupled: answers through its response sender, after a BLS call (its request came on ModelStreamInfer).
STREAMING = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            inputs = [pb_utils.get_input_tensor_by_name(request, n) for n in ("INPUT0", "INPUT1")]
            summed = pb_utils.InferenceRequest(model_name="simple", inputs=inputs, requested_output_names=["OUTPUT0"]).exec()
            request.get_response_sender().send(pb_utils.InferenceResponse(summed.output_tensors()),
                                               flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [{{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 1, 16 ] }}, {{ name: "INPUT1", data_type: TYPE_FP32, dims: [ 1, 16 ] }}]
output [{{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1, 16 ] }}, {{ name: "REPEATS", data_type: TYPE_INT32, dims: [ 1 ] }},
        {{ name: "PIECES", data_type: TYPE_INT32, dims: [ 1 ] }}]
"""


def write_models(repo, *names: str) -> None:
    sources = {"touter": OUTER, "tstream": STREAMING}
    for name in names:
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(sources.get(name, BLS))
        config = CONFIG.format(name=name)
        if name == "tstream":
            config += "model_transaction_policy { decoupled: true }\n"
        (repo / name / "config.pbtxt").write_text(config)


def infer(server, model: str, request_id: str) -> dict[str, np.ndarray]:
    inputs = {"INPUT0": X, "INPUT1": np.ones((1, 16), np.float32)}
    response = kserve.stub(server.channel).ModelInfer(kserve.request(model, inputs, request_id=request_id), timeout=120)
    return kserve.outputs(response)


@pytest.fixture(scope="module")
def bls_run(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple", "repeat_int32", "tiny_llama")
    write_models(repo, "tbls", "touter", "tquiet", "tstream")
    path = tmp_path_factory.mktemp("traces") / "trace.json"
    server = RunningServer(repo, "--trace-config", f"triton,file={path}", "--trace-config", "level=TIMESTAMPS",
                           "--trace-config", "rate=1", "--allow-trace-settings")
    seen = {}
    try:
        httpclient.InferenceServerClient(server.http_address).update_trace_settings(
            model_name="tquiet", settings={"trace_level": ["OFF"]})
        seen["bls"] = infer(server, "tbls", "bls-0")
        seen["outer"] = infer(server, "touter", "outer-0")
        seen["quiet"] = infer(server, "tquiet", "quiet-0")
        request = kserve.request("tstream", {"INPUT0": X, "INPUT1": np.ones((1, 16), np.float32)}, request_id="stream-0")
        seen["stream"] = list(kserve.stub(server.channel).ModelStreamInfer(iter([request]), timeout=120))
    finally:
        assert server.stop() == 0
    seen["traces"] = read_traces(path)
    return seen


def children_of(traces: dict[int, dict], parent: dict) -> dict[str, dict]:
    """The parent's child traces by called model (one call to each model per execute)."""
    found = [t for t in traces.values() if t["header"].get("parent_id") == parent["header"]["id"]]
    assert len(found) == len({t["header"]["model_name"] for t in found}), found
    return {t["header"]["model_name"]: t for t in found}


def root(traces: dict[int, dict], request_id: str) -> dict:
    [trace] = [t for t in traces.values() if t["header"]["request_id"] == request_id and "parent_id" not in t["header"]]
    return trace


def names(trace: dict) -> list[str]:
    return [n for n, _ in trace["stamps"]]


def assert_within(child: dict, parent: dict) -> None:
    """A BLS call starts once its caller's execute runs and ends before its caller's request does."""
    inner, outer = dict(child["stamps"]), dict(parent["stamps"])
    assert outer["COMPUTE_START"] <= inner["REQUEST_START"] and inner["REQUEST_END"] <= outer["REQUEST_END"]


def assert_bls_children(traces: dict[int, dict], caller: dict, answer: dict[str, np.ndarray], request_id: str) -> None:
    kids = children_of(traces, caller)
    assert set(kids) == {"simple", "repeat_int32", "tiny_llama"}
    simple, repeat, generation = kids["simple"], kids["repeat_int32"], kids["tiny_llama"]
    # trace=request.trace() with an id of the call's own; the others carry the caller's id
    assert simple["header"] == {"id": simple["header"]["id"], "model_name": "simple", "model_version": 1,
                                "request_id": request_id + "-simple", "parent_id": caller["header"]["id"]}
    assert_ordered(simple, STEP_ORDER)
    assert repeat["header"]["model_version"] == 1 and repeat["header"]["request_id"] == request_id
    assert_ordered(repeat, ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "INFER_RESPONSE_COMPLETE", "COMPUTE_END",
                            "REQUEST_END"])
    assert names(repeat).count("INFER_RESPONSE_COMPLETE") == len(REPEATS) == int(answer["REPEATS"][0])
    assert_ordered(generation, ["REQUEST_START", "QUEUE_START", "FIRST_TOKEN", "COMPUTE_END", "REQUEST_END"])
    assert names(generation).count("FIRST_TOKEN") == 1
    assert names(generation).count("INFER_RESPONSE_COMPLETE") == int(answer["PIECES"][0]) >= 1
    for child in kids.values():
        assert_within(child, caller)
        assert not any(n.startswith(("GRPC_", "HTTP_")) for n in names(child))  # no door: the call came from a model
    assert answer["OUTPUT0"].tolist() == (X + 1).tolist()


def test_each_bls_call_is_a_child_trace_of_the_request_that_made_it(bls_run):
    traces = bls_run["traces"]
    caller = root(traces, "bls-0")
    assert caller["header"]["model_name"] == "tbls"
    assert_ordered(caller, GRPC_ORDER)
    assert_bls_children(traces, caller, bls_run["bls"], "bls-0")


def test_calls_of_a_bls_call_are_its_children(bls_run):
    traces = bls_run["traces"]
    outer = root(traces, "outer-0")
    [called] = children_of(traces, outer).values()
    assert called["header"]["model_name"] == "tbls" and called["header"]["request_id"] == "outer-0"
    assert_ordered(called, STEP_ORDER)
    assert_within(called, outer)
    assert_bls_children(traces, called, bls_run["outer"], "outer-0")


def test_an_untraced_requests_bls_calls_are_not_traced(bls_run):
    traces = bls_run["traces"]
    assert bls_run["quiet"]["OUTPUT0"].tolist() == (X + 1).tolist()
    assert not [t for t in traces.values() if t["header"]["request_id"].startswith("quiet-0")]
    parents = {t["header"]["id"] for t in traces.values()}
    assert all(t["header"]["parent_id"] in parents for t in traces.values() if "parent_id" in t["header"])
    assert sorted(t["header"]["model_name"] for t in traces.values()) == sorted(
        ["tbls", "touter", "tbls", "tstream", "simple"] + ["simple", "repeat_int32", "tiny_llama"] * 2)
    assert int(bls_run["quiet"]["PIECES"][0]) >= 1 and int(bls_run["quiet"]["REPEATS"][0]) == len(REPEATS)


def test_a_decoupled_models_bls_call_is_a_child_of_its_streamed_request(bls_run):
    [response] = bls_run["stream"]
    assert kserve.outputs(response.infer_response)["OUTPUT0"].tolist() == (X + 1).tolist()
    traces = bls_run["traces"]
    caller = root(traces, "stream-0")
    assert caller["header"]["model_name"] == "tstream"
    [called] = children_of(traces, caller).values()
    assert called["header"]["model_name"] == "simple" and called["header"]["request_id"] == "stream-0"
    assert_ordered(called, STEP_ORDER)
    assert dict(caller["stamps"])["COMPUTE_START"] <= dict(called["stamps"])["REQUEST_START"]

"""Triton's trace extension: the trace file a real server writes, read as Triton's tools read it.

One server traces every request into a file while the test sends gRPC and HTTP infers, an ensemble, a
generation stream, and changes the settings through tritonclient (gRPC in a subprocess: its protobuf
messages clash with Ferry's; HTTP in this process). It is stopped cleanly, then the file is parsed:
Triton 2.51's layout (a header per trace, then one entry per timestamp), the timestamp names of each
protocol in the order a request passes them, ensemble steps under the ensemble's id, rate and count
obeyed. A second server writes indexed files (log-frequency) and refuses setting changes without the flag.
OpenTelemetry has its own file (test_tracing_otel.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

import grpc
import numpy as np
import pytest

from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from protos import grpc_service_pb2 as pb
from tests import kserve
from tests.conftest import RunningServer, link_shipped_models

httpclient = pytest.importorskip("tritonclient.http")

GRPC_ORDER = ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "REQUEST_START", "QUEUE_START", "COMPUTE_START",
              "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END", "INFER_RESPONSE_COMPLETE", "REQUEST_END",
              "GRPC_SEND_START", "GRPC_SEND_END"]
HTTP_ORDER = ["HTTP_RECV_START", "HTTP_RECV_END", *GRPC_ORDER[2:10], "HTTP_SEND_START", "HTTP_SEND_END"]
STEP_ORDER = GRPC_ORDER[2:10]
X = np.arange(16, dtype=np.float32).reshape(1, 16)
GEN_TOKENS = 6


def simple_inputs() -> dict[str, np.ndarray]:
    return {"INPUT0": X, "INPUT1": np.ones((1, 16), np.float32)}


def http_infer(client, model: str, inputs: dict[str, np.ndarray], request_id: str):
    tensors = []
    for name, array in inputs.items():
        tensor = httpclient.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return client.infer(model, tensors, request_id=request_id)


def grpc_infer(server, request_id: str) -> None:
    kserve.stub(server.channel).ModelInfer(kserve.request("simple", simple_inputs(), request_id=request_id), timeout=60)


def generate_stream(server, body: dict) -> list[dict]:
    """POST /v2/models/tiny_llama/generate_stream; the server-sent events, decoded."""
    post = urllib.request.Request(f"{server.http_url}/v2/models/tiny_llama/generate_stream", json.dumps(body).encode(),
                                  {"Content-Type": "application/json"})
    with urllib.request.urlopen(post, timeout=120) as reply:
        text = reply.read().decode()
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


def read_traces(path: Path) -> dict[int, dict]:
    """id -> {"header", "stamps": [(name, ns)], "tensors": [...]}; every entry checked against Triton's layout."""
    traces: dict[int, dict] = defaultdict(lambda: {"header": None, "stamps": [], "tensors": []})
    for entry in json.loads(path.read_text()):
        trace = traces[entry["id"]]
        if "model_name" in entry:
            assert set(entry) - {"parent_id"} == {"id", "model_name", "model_version", "request_id"}, entry
            assert isinstance(entry["model_version"], int)
            trace["header"] = entry
        elif "timestamps" in entry:
            assert set(entry) == {"id", "timestamps"} and len(entry["timestamps"]) == 1, entry
            stamp = entry["timestamps"][0]
            assert set(stamp) == {"name", "ns"} and isinstance(stamp["ns"], int), entry
            trace["stamps"].append((stamp["name"], stamp["ns"]))
        else:
            assert set(entry) == {"id", "activity", "tensor"}, entry
            trace["tensors"].append(entry)
    return dict(traces)


def named(traces: dict[int, dict], request_id: str) -> list[dict]:
    return [t for t in traces.values() if t["header"]["request_id"] == request_id]


def assert_ordered(trace: dict, order: list[str]) -> None:
    stamps = dict(trace["stamps"])
    assert [n for n in order if n not in stamps] == [], trace["stamps"]
    times = [stamps[n] for n in order]
    assert times == sorted(times), list(zip(order, times))


@pytest.fixture(scope="module")
def file_run(tmp_path_factory) -> dict:
    """The traced server's run: what the clients saw while it ran, then the files it left once stopped."""
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple", "pipeline", "preprocess", "postprocess", "tiny_llama")
    path = tmp_path_factory.mktemp("traces") / "trace.json"
    server = RunningServer(repo, "--trace-config", f"triton,file={path}", "--trace-config", "level=TIMESTAMPS",
                           "--trace-config", "rate=1", "--allow-trace-settings")
    seen = {}
    try:
        client = httpclient.InferenceServerClient(server.http_address)
        grpc_infer(server, "grpc-0")
        http_infer(client, "simple", simple_inputs(), "http-0")
        seen["ensemble"] = http_infer(client, "pipeline", {"RAW": X}, "ensemble-0").as_numpy("RESULT")
        request = gen.GenerateRequest(model_name="tiny_llama", id="gen-0", text="A ferry leaves",
                                      sampling=gen.SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True))
        seen["generated"] = list(gen_grpc.GenerationStub(server.channel).Generate(request, timeout=120))
        seen["sse"] = generate_stream(server, {"text_input": "A ferry leaves", "max_tokens": GEN_TOKENS,
                                               "ignore_eos": True, "id": "gen-http"})
        script = Path(__file__).with_name("trace_settings_calls.py")
        done = subprocess.run([sys.executable, str(script), server.address], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        seen["tritonclient_grpc"] = json.loads(done.stdout)
        for i in range(9):  # simple's own rate is 3 now: the 3rd, 6th and 9th are traced
            grpc_infer(server, f"rate-{i}")
        seen["cleared"] = client.update_trace_settings(model_name="simple", settings={"trace_rate": None})
        seen["tensors_on"] = client.update_trace_settings(model_name="simple",
                                                          settings={"trace_level": ["TIMESTAMPS", "TENSORS"]})
        seen["tensor_answer"] = http_infer(client, "simple", simple_inputs(), "tensors-0").as_numpy("OUTPUT0")
        client.update_trace_settings(model_name="simple", settings={"trace_level": None})
        seen["count_set"] = client.update_trace_settings(settings={"trace_count": "2"})
        for i in range(3):  # two traces left: count-0 and count-1, written to trace.json.0 once both are done
            grpc_infer(server, f"count-{i}")
        seen["count_after"] = client.get_trace_settings()
    finally:
        assert server.stop() == 0
    seen["traces"] = read_traces(path)
    seen["indexed"] = read_traces(Path(f"{path}.0"))
    seen["files"] = sorted(p.name for p in path.parent.iterdir())
    return seen


def test_grpc_infer_is_traced_with_tritons_names_in_order(file_run):
    [trace] = named(file_run["traces"], "grpc-0")
    assert trace["header"] == {"id": trace["header"]["id"], "model_name": "simple", "model_version": 1,
                               "request_id": "grpc-0"}
    assert_ordered(trace, GRPC_ORDER)
    assert not any(n.startswith("HTTP_") for n, _ in trace["stamps"])


def test_http_infer_is_traced_with_http_names_in_order(file_run):
    [trace] = named(file_run["traces"], "http-0")
    assert_ordered(trace, HTTP_ORDER)
    assert not any(n.startswith("GRPC_") for n, _ in trace["stamps"])


def test_ensemble_steps_are_traced_under_the_ensembles_id(file_run):
    traces = named(file_run["traces"], "ensemble-0")
    [parent] = [t for t in traces if t["header"]["model_name"] == "pipeline"]
    children = [t for t in traces if t is not parent]
    assert sorted(t["header"]["model_name"] for t in children) == ["postprocess", "preprocess", "simple"]
    assert all(t["header"]["parent_id"] == parent["header"]["id"] for t in children)
    assert "parent_id" not in parent["header"]
    start, end = dict(parent["stamps"])["REQUEST_START"], dict(parent["stamps"])["REQUEST_END"]
    for child in children:
        assert_ordered(child, STEP_ORDER)
        stamps = dict(child["stamps"])
        assert start <= stamps["REQUEST_START"] and stamps["REQUEST_END"] <= end
    steps = sorted(children, key=lambda t: dict(t["stamps"])["REQUEST_START"])
    assert [t["header"]["model_name"] for t in steps] == ["preprocess", "simple", "postprocess"]  # a chain
    assert file_run["ensemble"].shape == (1, 16)


def test_generation_stream_has_first_token_and_a_timestamp_per_response(file_run):
    [trace] = named(file_run["traces"], "gen-0")
    names = [n for n, _ in trace["stamps"]]
    assert names.count("INFER_RESPONSE_COMPLETE") == len(file_run["generated"]) >= 1
    assert names.count("FIRST_TOKEN") == 1
    assert_ordered(trace, ["GRPC_WAITREAD_START", "REQUEST_START", "FIRST_TOKEN", "REQUEST_END", "GRPC_SEND_START",
                           "GRPC_SEND_END"])
    responses = [ns for n, ns in trace["stamps"] if n == "INFER_RESPONSE_COMPLETE"]
    assert responses == sorted(responses) and responses[0] == dict(trace["stamps"])["FIRST_TOKEN"]
    assert sum(len(r.token_ids) for r in file_run["generated"]) == GEN_TOKENS


def test_http_generation_stream_is_traced_with_http_names(file_run):
    [trace] = named(file_run["traces"], "gen-http")
    names = [n for n, _ in trace["stamps"]]
    assert names.count("INFER_RESPONSE_COMPLETE") == len(file_run["sse"]) >= 1
    assert file_run["sse"][-1]["finish_reason"] == "length"
    assert_ordered(trace, ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "FIRST_TOKEN", "REQUEST_END",
                           "HTTP_SEND_START", "HTTP_SEND_END"])
    assert not any(n.startswith("GRPC_") for n in names)


def test_settings_read_and_changed_through_tritonclient_grpc(file_run):
    seen = file_run["tritonclient_grpc"]
    assert "trace" in seen["extensions"]
    assert seen["global"]["trace_level"] == ["TIMESTAMPS"] and seen["global"]["trace_rate"] == ["1"]
    assert seen["global"]["trace_mode"] == ["triton"] and seen["global"]["log_frequency"] == ["0"]
    assert seen["model_updated"]["trace_rate"] == ["3"] == seen["model"]["trace_rate"]
    assert seen["global_after"]["trace_rate"] == ["1"]  # the model's own setting, not the global one
    assert seen["bad"]["status"] == "StatusCode.INVALID_ARGUMENT" and "trace_rate" in seen["bad"]["message"]
    assert seen["unknown"]["status"] == "StatusCode.NOT_FOUND" and "no_such_model" in seen["unknown"]["message"]


def test_a_models_rate_samples_one_request_in_n(file_run):
    traced = sorted(t["header"]["request_id"] for t in file_run["traces"].values()
                    if t["header"]["request_id"].startswith("rate-"))
    assert traced == ["rate-2", "rate-5", "rate-8"]
    assert file_run["cleared"]["trace_rate"] == "1"  # null cleared the model's own rate: the global one again


def test_tensors_level_writes_inputs_and_outputs(file_run):
    assert file_run["tensors_on"]["trace_level"] == ["TIMESTAMPS", "TENSORS"]
    [trace] = named(file_run["traces"], "tensors-0")
    tensors = {(e["activity"], e["tensor"]["name"]): e["tensor"] for e in trace["tensors"]}
    assert set(tensors) == {("TENSOR_QUEUE_INPUT", "INPUT0"), ("TENSOR_QUEUE_INPUT", "INPUT1"),
                            ("TENSOR_BACKEND_OUTPUT", "OUTPUT0"), ("TENSOR_BACKEND_OUTPUT", "OUTPUT1")}
    out = tensors[("TENSOR_BACKEND_OUTPUT", "OUTPUT0")]
    assert out["dtype"] == "FP32" and out["shape"] == "1,16"
    assert np.array([float(v) for v in out["data"].split(",")]) == pytest.approx(file_run["tensor_answer"].ravel())


def test_count_stops_tracing_and_writes_an_indexed_file(file_run):
    assert file_run["count_set"]["trace_count"] == "2"
    assert file_run["count_after"]["trace_count"] == "0"
    assert sorted(t["header"]["request_id"] for t in file_run["indexed"].values()) == ["count-0", "count-1"]
    assert not named(file_run["traces"], "count-2") and not named(file_run["indexed"], "count-2")
    assert file_run["files"] == ["trace.json", "trace.json.0"]


@pytest.fixture(scope="module")
def frequency_run(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple")
    path = tmp_path_factory.mktemp("traces") / "trace.json"
    server = RunningServer(repo, "--trace-config", f"triton,file={path}", "--trace-config", "level=TIMESTAMPS",
                           "--trace-config", "rate=1", "--trace-config", "triton,log-frequency=2")
    seen = {}
    try:
        for i in range(5):
            grpc_infer(server, f"f-{i}")
        with pytest.raises(grpc.RpcError) as info:
            request = pb.TraceSettingRequest()
            request.settings["trace_rate"].value.append("5")
            kserve.stub(server.channel).TraceSetting(request, timeout=30)
        seen["grpc_refused"] = (info.value.code(), info.value.details())
        body = json.dumps({"trace_rate": "5"}).encode()
        post = urllib.request.Request(f"{server.http_url}/v2/trace/setting", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(post, timeout=30)
        seen["http_refused"] = (http.value.code, json.loads(http.value.read())["error"])
        with urllib.request.urlopen(f"{server.http_url}/v2/models/simple/trace/setting", timeout=30) as reply:
            seen["read"] = json.loads(reply.read())
    finally:
        assert server.stop() == 0
    seen["files"] = {p.name: read_traces(p) for p in path.parent.iterdir()}
    return seen


def test_log_frequency_writes_a_file_every_n_traces_and_the_rest_at_stop(frequency_run):
    files = frequency_run["files"]
    assert sorted(files) == ["trace.json.0", "trace.json.1", "trace.json.2"]
    ids = {name: sorted(t["header"]["request_id"] for t in traces.values()) for name, traces in files.items()}
    assert ids == {"trace.json.0": ["f-0", "f-1"], "trace.json.1": ["f-2", "f-3"], "trace.json.2": ["f-4"]}
    for traces in files.values():
        for trace in traces.values():
            assert_ordered(trace, GRPC_ORDER)


def test_settings_are_read_only_without_the_flag(frequency_run):
    code, details = frequency_run["grpc_refused"]
    assert code == grpc.StatusCode.PERMISSION_DENIED and "--allow-trace-settings" in details
    status, message = frequency_run["http_refused"]
    assert status == 403 and "--allow-trace-settings" in message
    assert frequency_run["read"] == {"trace_file": frequency_run["read"]["trace_file"], "trace_level": ["TIMESTAMPS"],
                                     "trace_rate": "1", "trace_count": "-1", "log_frequency": "2",
                                     "trace_mode": "triton"}

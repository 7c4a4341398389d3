"""Triton's Python backend API (`class TritonPythonModel`, `triton_python_backend_utils`) on Ferry, with
NVIDIA's tritonclient (in a subprocess) and Ferry's own gRPC stubs: execute per request, error responses
and raised exceptions, decoupled streams and cancellation, BLS (sync, async, decoupled, missing model,
is_model_ready), auto_complete_config, custom metrics, the Logger, and refusals at load."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import kserve, python_triton_models
from tests.conftest import RunningServer, wait_for

if importlib.util.find_spec("tritonclient") is None:
    pytest.skip(reason="tritonclient[grpc] is not installed (it is part of the test extra)", allow_module_level=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    python_triton_models.build(repo)
    server = RunningServer(repo)
    try:
        script = Path(__file__).with_name("python_triton_calls.py")
        done = subprocess.run([sys.executable, str(script), server.address], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        yield server, json.loads(done.stdout), repo
    finally:
        server.stop()


def test_initialize_gets_tritons_args_and_requests_their_accessors(served):
    server, result, repo = served
    good = result["batch"]["good"]
    assert good["sum"] == [[2.0, 2.0, 3.0, 4.0]]
    info = good["info"]
    args = info["args"]
    assert args["model_name"] == "tadd3" and args["model_version"] == "1" and args["model_instance_kind"] == "CPU"
    assert args["model_instance_name"] == "tadd3_0_0" and args["model_instance_device_id"] == "0"
    assert Path(args["model_repository"]) == repo / "tadd3"
    assert info["config_name"] == "tadd3" and info["max_batch_size"] == 8 and info["in_dims"] == [4]
    assert info["request_id"] == "r-good" and info["parameters"] == {"color": "red"}
    assert info["requested"] == ["SUM", "INFO"] and info["correlation_id"] == 0 and info["flags"] == 0
    assert info["is_cancelled"] is False and info["is_cpu"] is True and info["decoupled"] is False
    assert info["fp32"] == 11 and info["to_numpy"] == "float32"
    assert info["pid"] != server.proc.pid  # the model runs in a process of its own


def test_an_error_response_fails_its_request_alone_in_one_execute(served):
    _, result, _ = served
    batch = result["batch"]
    assert batch["good"]["info"]["requests"] == 3 and batch["other"]["info"]["requests"] == 3  # one execute
    assert batch["other"]["sum"] == [[3.0, 2.0, 3.0, 4.0]]
    assert batch["bad"]["status"] == "StatusCode.INVALID_ARGUMENT" and batch["bad"]["message"] == "negative input"


def test_a_raised_exception_fails_with_its_message_and_the_model_keeps_serving(served):
    _, result, _ = served
    assert result["raised"]["status"] == "StatusCode.INTERNAL"
    assert result["raised"]["message"] == ("Failed to process the request(s) for model instance 'tadd_0_0', message: "
                                           "ValueError: ninety-nine is not a number this model adds")  # no traceback
    assert result["after_raise"] == [[1.0, 2.0, 3.0, 4.0]]


def test_decoupled_responses_come_from_the_response_sender_then_the_final_flag(served):
    _, result, _ = served
    assert result["repeat"] == {"out": [[4, 0], [5, 1], [6, 2]], "finals": 1, "errors": []}


def test_a_cancelled_stream_is_seen_by_is_cancelled(served):
    server, result, _ = served
    assert result["wait"]["out"] == [[1]]
    server.wait_for_metric("test_cancelled_seen", 1.0, timeout_s=60, model="twait")


def test_bls_sync_async_decoupled_and_errors_go_through_the_called_models(served):
    server, result, _ = served
    bls = result["bls"]
    assert bls["SUM"] == [[11.0, 12.0, 13.0, 14.0]] and bls["TWICE"] == [[22.0, 24.0, 26.0, 28.0]]
    assert bls["STREAM"] == [0, 1, 2, 3, 4]
    assert bls["MISSING_CODE"] == [2] and "nope" in bls["MISSING"]  # TritonError.NOT_FOUND, naming the model
    assert bls["READY"] == [True, False]
    if not Path("/proc/driver/nvidia/gpus").is_dir():  # without a GPU, a call preferring GPU memory is refused
        assert "preferred_memory asks TRITONSERVER_MEMORY_GPU but this machine has no GPU" in bls["GPU"][0]
    else:  # with one, it runs and its outputs are host tensors (the log says so)
        assert bls["GPU"] == [""]
    # The BLS calls were tadd's own requests: counted in its statistics with everyone else's.
    stats = kserve.stub(server.channel).ModelStatistics(pb.ModelStatisticsRequest(name="tadd"), timeout=30)
    assert stats.model_stats[0].inference_stats.success.count == 1 + 3  # after_raise, and the 3 BLS calls


def test_auto_complete_config_completes_a_folder_without_a_config(served):
    _, result, _ = served
    config = result["auto_config"]
    assert config["max_batch_size"] == 4 and "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("X", "TYPE_FP32", ["2"])]
    assert [t["name"] for t in config["output"]] == ["Y"]
    assert result["auto"] == [[3.0, 6.0]]


def test_custom_metrics_of_every_kind_reach_the_metrics_page_and_logger_the_log(served):
    server, result, _ = served
    assert result["metrics"] == [[1.0], [2.0], [3.0]]  # Metric.value() as the model reads it
    labels = {"model": "tmetrics", "version": "1"}
    assert server.metric("test_requests", **labels) == 3.0
    assert server.metric("test_last_x", **labels) == 50.0
    assert server.metric("test_x_bucket", le="1", **labels) == 1.0
    assert server.metric("test_x_bucket", le="10", **labels) == 2.0
    assert server.metric("test_x_count", **labels) == 3.0 and server.metric("test_x_sum", **labels) == 55.5
    import urllib.request

    page = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert "# TYPE test_requests counter" in page and "test_requests{" in page  # Triton's bare counter name
    wait_for(lambda: "model 'tmetrics': tmetrics saw 50.0" in server.output, 30, "the model's log line")


def test_execution_env_path_is_refused_at_load_with_the_reason(served):
    server, _, _ = served
    index = kserve.stub(server.channel).RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30)
    row = next(m for m in index.models if m.name == "tenv")
    assert row.state == "UNAVAILABLE" and "EXECUTION_ENV_PATH" in row.reason and "not supported" in row.reason


def test_is_ready_is_asked_on_every_ready_check(served):
    import urllib.error
    import urllib.request

    server, _, repo = served

    def ready() -> tuple[bool, bool]:
        by_grpc = kserve.stub(server.channel).ModelReady(pb.ModelReadyRequest(name="tready"), timeout=30).ready
        try:
            by_http = urllib.request.urlopen(f"{server.http_url}/v2/models/tready/ready", timeout=30).status == 200
        except urllib.error.HTTPError:
            by_http = False
        return by_grpc, by_http

    assert ready() == (True, True)
    (repo / "tready" / "not_ready").write_text("")
    assert ready() == (False, False)
    (repo / "tready" / "not_ready").unlink()
    assert ready() == (True, True)


def post(server, path: str, body: dict) -> str:
    import urllib.request

    request = urllib.request.Request(f"{server.http_url}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read().decode()


def test_tritons_http_generate_takes_inputs_by_name_and_streams_a_decoupled_model(served):
    server, _, _ = served
    events = [json.loads(line[len("data: "):]) for line in post(server, "/v2/models/trepeat/generate_stream",
                                                                  {"IN": [4, 5, 6]}).splitlines() if line]
    assert [(e["OUT"], e["IDX"]) for e in events] == [(4, 0), (5, 1), (6, 2)]
    answer = json.loads(post(server, "/v2/models/tadd/generate", {"INPUT0": [1, 2, 3, 4], "INPUT1": [1, 1, 1, 1]}))
    assert answer["model_name"] == "tadd" and answer["SUM"] == [2.0, 3.0, 4.0, 5.0]


def control(server, op: int) -> bool:
    return bool(kserve.infer(server.channel, "tcontrol", {"OP": np.array([op], np.int32)})["READY"][0])


def test_load_and_unload_from_model_code_follow_the_model_control_mode(served, tmp_path):
    server, _, _ = served
    with pytest.raises(grpc.RpcError) as refused:  # this server runs with --model-control-mode none
        control(server, 0)
    assert refused.value.code() == grpc.StatusCode.INTERNAL and "--model-control-mode explicit" in refused.value.details()
    assert control(server, 2) is True
    repo = tmp_path / "repo"
    python_triton_models.build(repo)
    explicit = RunningServer(repo, "--model-control-mode", "explicit", "--load-model", "*")
    try:
        assert control(explicit, 0) is False
        assert not kserve.stub(explicit.channel).ModelReady(pb.ModelReadyRequest(name="tadd"), timeout=30).ready
        assert control(explicit, 1) is True
        assert kserve.stub(explicit.channel).ModelReady(pb.ModelReadyRequest(name="tadd"), timeout=30).ready
    finally:
        explicit.stop()


def test_model_processes_end_with_the_server(served):
    server, result, _ = served
    pid = result["batch"]["good"]["info"]["pid"]
    os.kill(pid, 0)  # alive while the server serves
    server.stop()
    wait_for(lambda: not _alive(pid), 30, "the model process to end with the server")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

"""Triton's Python API beyond the basics, with NVIDIA's tritonclient (grpc and http, in a subprocess):
response parameters reach the client and BLS callers; BLS to a generation model answers as calling it
directly does; a caller that leaves cancels the BLS calls its request made (a queued one never runs, a
generation stops); pb_utils.load_model with a config override and inline files, under the same rules as
the LoadModel RPC."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from tests import builders, kserve, python_bls_models
from tests.conftest import RunningServer, wait_for

pytest.importorskip("transformers", reason="transformers builds the tiny generation model (test extra)")
if importlib.util.find_spec("tritonclient") is None:  # never imported here: its protobufs clash with ours
    pytest.skip(reason="tritonclient[grpc,http] is not installed (test extra)", allow_module_level=True)

from tests import llm_builders  # after the skip: it needs transformers

SCRIPT = Path(__file__).with_name("python_bls_calls.py")
TLOADED = {"name": "tloaded", "backend": "onnxruntime", "max_batch_size": 4,
           "input": [{"name": n, "data_type": "TYPE_FP32", "dims": [4]} for n in ("INPUT0", "INPUT1")],
           "output": [{"name": n, "data_type": "TYPE_FP32", "dims": [4]} for n in ("OUTPUT0", "OUTPUT1")]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    flag, gate = repo.parent / "bls.flag", repo.parent / "bls.gate"
    python_bls_models.build(repo, flag)
    # Room for a generation no CPU finishes within the tests' bounds (python_bls_models.ENDLESS_TOKENS).
    llm_builders.build_model(repo / "tllm" / "1", "llama", max_positions=python_bls_models.ENDLESS_TOKENS + 64)
    (repo / "tllm" / "config.yaml").write_text(
        llm_builders.llm_config(block_size=16, num_kv_blocks=python_bls_models.ENDLESS_TOKENS // 16 + 64))
    builders.gated_model(repo, "tgated", gate=gate, max_batch_size=1, hold_s=600)  # the tests open it
    builders.add_sub(repo / "tloaded" / "1" / "model.onnx")
    (repo / "tloaded" / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 8\n')
    server = RunningServer(repo, "--model-control-mode", "explicit", "--load-model", "*")
    server.flag, server.gate, server.repo = flag, gate, repo
    yield server
    server.stop()


def calls(server, *args: str) -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT), server.address, server.http_address, *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- 1. response parameters

def test_response_parameters_reach_grpc_http_streams_and_bls_callers(served):
    out = calls(served, "params")
    assert out["grpc_y"] == [8]
    assert out["grpc"] == {"even": True, "count": 4, "label": "x=4"}  # bool_param, int64_param, string_param
    assert out["http"] == {"even": False, "count": 3, "label": "x=3"}
    assert out["http_none"] is False  # a response without parameters has no "parameters" key
    streamed = [(outputs.get("Y", []), {k: v for k, v in params.items() if k != "triton_final_response"},
                 params["triton_final_response"]) for outputs, params in out["stream"]]
    assert streamed == [([0], {"index": 0, "last": False, "tag": "stream"}, False),
                        ([1], {"index": 1, "last": False, "tag": "stream"}, False),
                        ([2], {"index": 2, "last": True, "tag": "stream"}, False),
                        ([], {}, True)]  # Triton's empty final response
    assert out["bls"] == {"one": {"even": True, "count": 2, "label": "x=2"},
                          "stream": [{"index": 0, "last": False, "tag": "stream"},
                                     {"index": 1, "last": True, "tag": "stream"}, {}]}


def test_a_parameter_of_another_type_is_refused_with_tritons_message(served):
    refused = calls(served, "params")["refused"]
    assert refused["status"] == "StatusCode.INTERNAL"
    assert refused["message"] == ("Failed to process the request(s) for model instance 'tparams_0_0', message: "
                                  "Expect parameters values to have type bool/int/str, found type <class 'float'>")


def test_response_parameters_cross_the_front_end_processes(tmp_path):
    python_bls_models.write(tmp_path, "tparams", python_bls_models.PARAMS, python_bls_models.PARAMS_CONFIG)
    server = RunningServer(tmp_path, "--frontend-processes", "2")
    try:
        for x in (5, 6):  # more calls than front ends: whichever answers, the parameters come along
            response = kserve.stub(server.channel).ModelInfer(
                kserve.request("tparams", {"X": np.array([x], np.int32)}), timeout=60)
            params = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in response.parameters.items()}
            assert params == {"even": x % 2 == 0, "count": x, "label": f"x={x}"}
    finally:
        server.stop()


# ---- 2. BLS to a generation model

def test_bls_to_a_generation_model_answers_as_calling_it_directly(served):
    before = served.metric("nv_inference_request_success", model="tllm", version="1") or 0.0
    out = calls(served, "generate", "the ferry leaves when", "12")
    bls, direct = out["bls"], out["direct"]
    assert len(direct) == 1 and direct[0].startswith("the ferry leaves when")  # the whole text, prompt first
    assert bls["text_output"] == direct  # exec(): the whole text, greedy, equal to the direct call's
    assert len(out["direct_stream"]) == 12 and bls["PIECES"] == out["direct_stream"]  # a piece per token
    assert "the ferry leaves when" + "".join(bls["PIECES"]) == direct[0]
    assert bls["COUNT"] == [12 + 1]  # exec(decoupled=True): one response per piece, then the final empty one
    assert bls["FINISH"] == ["length"]
    # The BLS calls were the generation model's own requests, counted with the direct ones.
    served.wait_for_metric("nv_inference_request_success", before + 4, timeout_s=60, model="tllm", version="1")


# ---- 3. cancellation follows BLS calls

def _start_cancel(served, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(SCRIPT), served.address, served.http_address, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "sent", proc.stderr.read()
    return proc


def _finish(proc: subprocess.Popen, cancel: bool) -> dict:
    out, err = proc.communicate("cancel\n" if cancel else "", timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _outcomes(served, *codes: str, seen: tuple[str, ...] = ("True", "False")) -> float:
    """How many BLS calls of tcancel_bls ended with one of `codes` ("ok": answered), the model seeing its
    request cancelled (`seen` "True") or not."""
    return sum(served.metric("test_bls_outcome", code=code, seen_cancelled=s) or 0.0 for code in codes for s in seen)


def _hold_gated(served):
    """A request to tgated that runs and holds its only instance until the test opens the gate."""
    held = threading.Thread(target=kserve.infer, args=(served.channel, "tgated", {"X": -np.ones((1, 2), np.float32)}),
                            daemon=True)
    held.start()
    wait_for(lambda: Path(str(served.gate) + ".running").exists(), 60, "the held request to run")
    return held


@pytest.mark.parametrize("how", ["cancel", "deadline", "stream"])
def test_a_queued_bls_call_of_a_request_whose_caller_left_never_runs(served, how):
    """`cancel`: the call is cancelled; `deadline`: its gRPC deadline passes; `stream`: a decoupled
    model's request, its stream cancelled."""
    served.gate.unlink(missing_ok=True)
    Path(str(served.gate) + ".running").unlink(missing_ok=True)
    labels = {"model": "tgated", "version": "1"}
    ran = served.metric("nv_inference_exec_count", **labels) or 0.0
    ended, seen = _outcomes(served, "1", "7"), _outcomes(served, "7", seen=("True",))
    held = _hold_gated(served)
    try:
        proc = _start_cancel(served, *(["cancel_stream"] if how == "stream" else ["cancel", "0", how]))
        if how != "deadline":
            wait_for(lambda: served.metric("nv_inference_pending_request_count", **labels) == 1, 60, "the BLS call to queue")
        result = _finish(proc, cancel=how != "deadline")
        if how == "deadline":
            # The BLS call inherits the caller's deadline and expires in tgated's queue at that moment; the
            # model then answers its caller, whose own deadline fires at the same moment: which of the two
            # the client sees first is a race, so only the server-side outcome below is asserted.
            assert result["answered"] is False or result["error"] is None, result
        else:
            assert result["answered"] is False, result
        if how == "cancel":
            assert "cancel" in result["error"].lower() or "deadline" in result["error"].lower(), result
        elif how == "deadline" and not result["answered"]:
            assert "deadline" in result["error"].lower(), result
        wait_for(lambda: served.metric("nv_inference_pending_request_count", **labels) == 0, 60,
                 "the BLS call to leave the queue")
        wait_for(lambda: _outcomes(served, "1", "7") == ended + 1, 60, "the BLS call to end")
    finally:
        served.gate.write_text("")  # a failure above must not leave the instance held for the next test
        held.join(60)
    assert served.metric("nv_inference_exec_count", **labels) == ran + 1  # the held request only
    assert _outcomes(served, "ok") == 0
    if how != "deadline":  # the model saw its request cancelled, and its BLS call answered CANCELLED
        assert _outcomes(served, "7", seen=("True",)) == seen + 1


def test_a_generation_a_cancelled_request_called_by_bls_stops(served):
    """The generation asks for ENDLESS_TOKENS, eos ignored: it cannot end by itself within the bounds
    here, so only the cancel that follows the BLS call ends it, counted CANCELED and never a success."""
    labels = {"model": "tllm", "version": "1"}
    succeeded = served.metric("nv_inference_request_success", **labels) or 0.0
    cancelled = served.metric("nv_inference_request_failure", reason="CANCELED", **labels) or 0.0
    Path(str(served.flag) + ".streaming").unlink(missing_ok=True)
    proc = _start_cancel(served, "cancel", "1", "cancel")
    wait_for(lambda: Path(str(served.flag) + ".streaming").exists(), 120, "the generation to stream")
    result = _finish(proc, cancel=True)
    assert result["answered"] is False and "cancel" in result["error"].lower(), result
    wait_for(lambda: served.metric("nv_inference_request_failure", reason="CANCELED", **labels) == cancelled + 1, 120,
             "the generation to be cancelled")
    assert served.metric("nv_inference_request_success", **labels) == succeeded  # it never ran to its end
    served.wait_for_metric("ferry_generation_running", 0, timeout_s=120, model="tllm")  # it left the running batch


# ---- 4. load_model with a config and files

def test_load_model_with_a_config_override_and_files_follows_the_load_rpcs_rules(served, tmp_path):
    config = dict(TLOADED)
    out = calls(served, "load", "tloaded", json.dumps(config), "")
    assert out["said"] == "ready" and out["config"]["max_batch_size"] == 4  # the override, not the folder's 8
    assert out["sum"] == [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]
    onnx = builders.add_sub(tmp_path / "model.onnx")
    refused = calls(served, "load", "tuploaded", json.dumps({**config, "name": "tuploaded"}), str(onnx))
    assert "--allow-model-upload" in refused["said"] and "file:1/model.onnx" in refused["said"]

    repo = tmp_path / "repo"
    python_bls_models.write(repo, "tloader", python_bls_models.LOADER, python_bls_models.LOADER_CONFIG)
    upload = RunningServer(repo, "--model-control-mode", "explicit", "--load-model", "*", "--allow-model-upload")
    none = RunningServer(repo)
    try:
        out = calls(upload, "load", "tuploaded", json.dumps({**config, "name": "tuploaded"}), str(onnx))
        assert out["said"] == "ready" and out["sum"] == [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]
        broken = calls(upload, "load", "tbroken", "", str(onnx))["said"]  # files without a config, as Triton refuses
        assert broken.startswith("failed to load") and "'config'" in broken, broken
        said = calls(none, "load", "tloaded", json.dumps(config), "")["said"]
        assert "--model-control-mode explicit" in said  # a config override alone needs explicit model control
    finally:
        upload.stop()
        none.stop()

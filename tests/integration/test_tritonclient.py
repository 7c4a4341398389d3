"""NVIDIA's tritonclient[grpc], unchanged from PyPI, against Ferry."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import builders
from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from tests.conftest import RunningServer, link_shipped_models

# find_spec, not import: importing tritonclient here would clash with Ferry's `inference.*` messages
if importlib.util.find_spec("tritonclient") is None:
    pytest.skip(reason="tritonclient[grpc] is not installed (it is part of the test extra)", allow_module_level=True)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("repo")
    builders.script_models(repo)
    link_shipped_models(repo, "tiny_llama")
    server = RunningServer(repo, "--allow-log-settings")  # update_log_settings: off by default
    try:
        script = Path(__file__).with_name("tritonclient_calls.py")
        done = subprocess.run([sys.executable, str(script), server.address], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout)
        request = gen.GenerateRequest(model_name="tiny_llama", text="A ferry leaves",
                                      sampling=gen.SamplingParams(max_tokens=8, ignore_eos=True))
        found["generate_text"] = "".join(r.text for r in gen_grpc.GenerationStub(server.channel).Generate(request, timeout=60))
        return found
    finally:
        server.stop()


def test_health_and_metadata(result):
    assert result["live"] and result["ready"] and result["model_ready"]
    assert "statistics" in result["extensions"]
    meta = result["model_metadata"]
    assert meta["platform"] == "onnxruntime_onnx"
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("INPUT0", "FP32", ["-1", "4"]), ("INPUT1", "FP32", ["-1", "4"])]
    assert result["config"]["max_batch_size"] == 4 and result["config"]["input"][0]["data_type"] == "TYPE_FP32"


def test_log_settings_read_and_changed_by_tritonclient(result):
    assert "logging" in result["extensions"]
    assert result["log_settings"]["log_verbose_level"] == {"uint32_param": 0}
    assert result["log_settings"]["log_info"] == {"bool_param": True}
    assert result["log_updated"]["log_verbose_level"] == {"uint32_param": 1}


def test_infer_outputs_and_bytes(result):
    assert result["sum_ok"] and result["diff_ok"] and result["id"] == "t-1"
    assert result["subset_outputs"] == ["OUTPUT1"]
    assert result["bytes_ok"]


def test_errors_reach_tritonclient_with_status(result):
    assert result["unknown_model"]["status"] == "StatusCode.NOT_FOUND"
    assert "Request for unknown model" in result["unknown_model"]["message"]
    assert result["wrong_dtype"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "INPUT0" in result["wrong_dtype"]["message"]


def test_index_and_statistics(result):
    states = {m["name"]: m["state"] for m in result["index"]}
    assert states == {"broken": "UNAVAILABLE", "echo": "READY", "simple": "READY", "tiny_llama": "READY"}
    stats = result["stats"]
    assert stats["inference_count"] == "4" and stats["execution_count"] == "2"  # two infers of 2 rows each


def test_model_stream_infer_keeps_order_and_streams_generation(result):
    stream = result["stream"]
    assert stream["order"] == ["s0", "s1", "s2"] and stream["sums_ok"]  # answered in the order sent, correctly
    assert len(stream["deltas"]) == 8  # one response per generated token, the last marked final
    assert "".join(stream["deltas"]) == result["generate_text"]  # same text as the Generate RPC
    assert len(stream["errors"]) == 1 and "unknown model" in stream["errors"][0]  # and the stream went on

"""The HTTP door's parity with Triton's: system shared memory through tritonclient.http unchanged (run in a
subprocess: tests/integration/http_shm_calls.py), CUDA shared memory clean-up answered as on a server
without a GPU, `--server-name` in GET /v2, and the model configuration's zero-valued fields."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from onnx import TensorProto, helper

from tests import builders
from tests.conftest import RunningServer

if importlib.util.find_spec("tritonclient.http") is None or importlib.util.find_spec("geventhttpclient") is None:
    pytest.skip(reason="tritonclient[http] is not installed (test extra)", allow_module_level=True)
if not Path("/dev/shm").is_dir():
    pytest.skip(reason="system shared memory needs /dev/shm", allow_module_level=True)

SIMPLE_CONFIG = """
max_batch_size: 8
input: [{name: INPUT0, data_type: %(t)s, dims: [16]}, {name: INPUT1, data_type: %(t)s, dims: [16]}]
output: [{name: OUTPUT0, data_type: %(t)s, dims: [16]}, {name: OUTPUT1, data_type: %(t)s, dims: [16]}]
"""


def simple_models(repo: Path) -> None:
    """Triton's 'simple' (INT32 add/sub, [16]) and 'simple_string' (the same on numbers written as strings)."""
    int32 = [builders.tensor(n, TensorProto.INT32, ["batch", 16]) for n in ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1")]
    builders.save_onnx([helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
                        helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
                       int32[:2], int32[2:], repo / "simple" / "1" / "model.onnx")
    (repo / "simple" / "config.yaml").write_text(SIMPLE_CONFIG % {"t": "TYPE_INT32"})
    strings = [builders.tensor(n, TensorProto.STRING, ["batch", 16]) for n in ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1")]
    cast = [helper.make_node("Cast", [n], [f"{n}_i"], to=TensorProto.INT32) for n in ("INPUT0", "INPUT1")]
    builders.save_onnx(cast + [helper.make_node("Add", ["INPUT0_i", "INPUT1_i"], ["sum"]),
                               helper.make_node("Sub", ["INPUT0_i", "INPUT1_i"], ["diff"]),
                               helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
                               helper.make_node("Cast", ["diff"], ["OUTPUT1"], to=TensorProto.STRING)],
                       strings[:2], strings[2:], repo / "simple_string" / "1" / "model.onnx")
    (repo / "simple_string" / "config.yaml").write_text(SIMPLE_CONFIG % {"t": "TYPE_STRING"})


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    simple_models(repo)
    builders.densenet_like(repo)
    server = RunningServer(repo, "--server-name", "triton", "--allow-shared-memory")
    tag = f"ferry_http_shm_{os.getpid()}"
    try:
        script = Path(__file__).with_name("http_shm_calls.py")
        done = subprocess.run([sys.executable, str(script), server.http_address, tag], capture_output=True, text=True,
                              timeout=120)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_simple_http_shm_client_flow(found):
    shm = found["shm"]
    assert shm["sum"] == [[i + 1 for i in range(16)]] and shm["difference"] == [[i - 1 for i in range(16)]]
    assert shm["output0"] == {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": {
        "shared_memory_region": "output_data", "shared_memory_byte_size": 64}}
    assert shm["output1"]["parameters"] == {"shared_memory_region": "output_data", "shared_memory_byte_size": 64,
                                            "shared_memory_offset": 64}
    tag = f"ferry_http_shm_{os.getpid()}"
    assert sorted(shm["status"], key=lambda r: r["name"]) == [
        {"name": "input_data", "key": f"/{tag}_input_simple", "offset": 0, "byte_size": 128},
        {"name": "output_data", "key": f"/{tag}_output_simple", "offset": 0, "byte_size": 128}]
    assert [r["name"] for r in shm["one_status"]] == ["input_data"]
    assert shm["status_after"] == [] and shm["mapped_before_destroy"] == 2


def test_cuda_shared_memory_clean_up_succeeds_and_registering_is_refused(found):
    shm = found["shm"]
    assert shm["cuda_status"] == []  # and unregister_cuda_shared_memory() at the start raised nothing
    assert shm["errors"]["cuda_register"]["status"] == "501"
    assert "CUDA shared memory is not implemented by Ferry" in shm["errors"]["cuda_register"]["message"]
    assert "/v2/systemsharedmemory/region/c/register" in shm["errors"]["cuda_register"]["message"]
    assert shm["errors"]["cuda_one_status"] == {"status": "404", "message": "Unable to find cuda shared memory region: 'c'"}


def test_shared_memory_errors_are_the_grpc_doors_words(found):
    errors = found["shm"]["errors"]
    expected = {
        "twice": ("409", "shared memory region 'input_data' already in manager"),
        "no_key": ("404", "Unable to open shared memory region:"),
        "unknown_status": ("404", "Unable to find system shared memory region: 'nope'"),
        "too_small": ("400", "output 'OUTPUT0' (16 bytes) should be at least 64 bytes"),
        "unregistered": ("404", "Unable to find shared memory region: 'input_data'"),
    }
    for key, (status, words) in expected.items():
        assert errors[key]["status"] == status and words in errors[key]["message"], (key, errors[key])


def test_simple_http_shm_string_client_flow(found):
    strings = found["strings"]
    assert [strings["OUTPUT0"], strings["OUTPUT1"]] == strings["expected"]


def test_server_name_and_zero_valued_config_fields(found):
    meta = found["metadata"]
    assert meta["server"]["name"] == "triton"
    assert "system_shared_memory" in meta["server"]["extensions"]
    assert meta["max_batch_size"] == 0 and meta["dims"] == [3, 4, 4]  # numbers, as Triton writes them
    assert {"platform", "backend", "input", "output", "instance_group", "parameters"} <= set(meta["config_keys"])

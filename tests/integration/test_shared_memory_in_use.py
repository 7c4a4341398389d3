"""Shared memory details as Triton's shared memory tests exercise them, with raw httpx and Ferry's gRPC
stub: a region unregistered while a request that named it runs stays registered until that request
ends (then goes by itself), registering past the object's end is Triton's `invalid args`, and CUDA
registration checks its arguments (and the server's permission) before saying it is not supported."""

from __future__ import annotations

import base64
import os
import threading
import uuid

import grpc
import httpx
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer, wait_for

X = np.array([[-1, -2]], np.float32)  # negative: the gated model holds it until its gate opens


@pytest.fixture
def shm_objects():
    """Two 64-byte POSIX shared memory objects (/dev/shm files), removed afterwards; their keys."""
    keys = [f"/ferry_test_{uuid.uuid4().hex[:12]}_{i}" for i in range(2)]
    for key in keys:
        with open(f"/dev/shm{key}", "wb") as f:
            f.write(X.tobytes() + bytes(64 - X.nbytes))
    yield keys
    for key in keys:
        os.unlink(f"/dev/shm{key}")


@pytest.fixture
def server(tmp_path):
    gate = tmp_path / "gate"
    builders.gated_model(tmp_path, "held", gate=gate)
    running = RunningServer(tmp_path, "--allow-shared-memory")
    running.gate = gate
    yield running
    gate.touch()
    running.stop()


def shm(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.http_url}/v2/{path}", timeout=60, **kwargs)


def listed(server) -> list[str]:
    return sorted(r["name"] for r in httpx.get(f"{server.http_url}/v2/systemsharedmemory/status", timeout=60).json())


def register(server, keys) -> None:
    for name, key in zip(("in", "out"), keys):
        answer = shm(server, f"systemsharedmemory/region/{name}/register", json={"key": key, "offset": 0, "byte_size": 64})
        assert answer.status_code == 200, answer.text


def http_call(server) -> httpx.Response:
    region = {"shared_memory_region": "in", "shared_memory_byte_size": X.nbytes}
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2], "parameters": region}],
            "outputs": [{"name": "Y", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 64}}]}
    return shm(server, "models/held/infer", json=body)


def grpc_call(server) -> pb.ModelInferResponse:
    request = pb.ModelInferRequest(model_name="held")
    tensor = request.inputs.add(name="X", datatype="FP32", shape=[1, 2])
    tensor.parameters["shared_memory_region"].string_param = "in"
    tensor.parameters["shared_memory_byte_size"].int64_param = X.nbytes
    out = request.outputs.add(name="Y")
    out.parameters["shared_memory_region"].string_param = "out"
    out.parameters["shared_memory_byte_size"].int64_param = 64
    return kserve.stub(server.channel).ModelInfer(request, timeout=120)


@pytest.mark.parametrize("door", ["http", "grpc"])
def test_a_region_unregistered_while_in_use_stays_until_the_request_ends(server, shm_objects, door):
    register(server, shm_objects)
    answers = []
    caller = threading.Thread(target=lambda: answers.append((http_call if door == "http" else grpc_call)(server)))
    caller.start()
    wait_for(lambda: (server.gate.parent / "gate.running").exists(), what="the request to hold at the gate")
    assert shm(server, "systemsharedmemory/unregister").status_code == 200  # no error, as Triton
    assert listed(server) == ["in", "out"]  # in use: still registered
    server.gate.touch()
    caller.join(120)
    answer = answers[0]
    if door == "http":
        assert answer.status_code == 200, answer.text
    with open(f"/dev/shm{shm_objects[1]}", "rb") as f:  # the output was written into the region
        assert np.frombuffer(f.read(X.nbytes), np.float32).tolist() == X.ravel().tolist()
    assert listed(server) == []  # gone with its last request, without another call
    assert httpx.get(f"{server.http_url}/v2/systemsharedmemory/region/in/status", timeout=60).status_code == 404


def test_registering_past_the_objects_end_is_invalid_args(server, shm_objects):
    for offset, size in ((0, 65), (1, 64), (64, 1), (65, 0)):
        answer = shm(server, "systemsharedmemory/region/r/register", json={"key": shm_objects[0], "offset": offset, "byte_size": size})
        assert answer.status_code == 400, answer.text
        assert "failed to register shared memory region" in answer.json()["error"] and "invalid args" in answer.json()["error"]
    assert listed(server) == []


def test_tritons_words_for_a_bad_key_and_an_overflowing_placement(server, shm_objects):
    bad = shm(server, "systemsharedmemory/region/r/register", json={"key": "///", "offset": 0, "byte_size": 8})
    assert bad.status_code == 400 and "cannot register shared memory region 'r' - invalid shm key '///'" in bad.json()["error"]
    register(server, shm_objects)
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}],
            "outputs": [{"name": "Y", "parameters": {"shared_memory_region": "out", "shared_memory_offset": 32,
                                                     "shared_memory_byte_size": 2**64 - 32}}]}
    answer = shm(server, "models/held/infer", json=body)
    assert answer.status_code == 400 and "Integer overflow detected: byte_size" in answer.json()["error"], answer.text


@pytest.mark.parametrize("body, words", [
    ({"raw_handle": {"b64": base64.b64encode(bytes(64)).decode()}, "device_id": 0, "byte_size": 0}, "byte_size must be positive"),
    ({"raw_handle": {"b64": base64.b64encode(bytes(64)).decode()}, "device_id": -1, "byte_size": 8}, "device_id"),
    ({"device_id": 0, "byte_size": 8}, "needs 'raw_handle'"),
])
def test_cuda_registration_checks_its_arguments_first(server, body, words):
    answer = shm(server, "cudasharedmemory/region/c/register", json=body)
    assert answer.status_code == 400 and words in answer.json()["error"], answer.text
    fine = shm(server, "cudasharedmemory/region/c/register",
               json={"raw_handle": {"b64": base64.b64encode(bytes(64)).decode()}, "device_id": 0, "byte_size": 8})
    assert fine.status_code == 501 and "CUDA shared memory is not implemented" in fine.json()["error"]


def test_cuda_registration_on_a_server_without_shared_memory_says_so_first(tmp_path):
    builders.add_sub(tmp_path / "simple" / "1" / "model.onnx")
    server = RunningServer(tmp_path)
    try:
        answer = shm(server, "cudasharedmemory/region/c/register", json={"device_id": 0, "byte_size": 0, "raw_handle": {"b64": ""}})
        assert answer.status_code == 403 and "Client shared memory is disabled" in answer.json()["error"], answer.text
        request = pb.CudaSharedMemoryRegisterRequest(name="c", raw_handle=bytes(64), device_id=0, byte_size=8)
        with pytest.raises(grpc.RpcError) as info:
            kserve.stub(server.channel).CudaSharedMemoryRegister(request, timeout=60)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "Client shared memory is disabled" in info.value.details()
    finally:
        server.stop()


@pytest.mark.parametrize("flag, allowed", [("--allow-client-shm=true", True), ("--allow-client-shm=false", False)])
def test_tritons_allow_client_shm_flag(tmp_path, shm_objects, flag, allowed):
    builders.add_sub(tmp_path / "simple" / "1" / "model.onnx")
    server = RunningServer(tmp_path, flag)
    try:
        answer = shm(server, "systemsharedmemory/region/r/register", json={"key": shm_objects[0], "offset": 0, "byte_size": 64})
        assert answer.status_code == (200 if allowed else 403), answer.text
        assert listed(server) == (["r"] if allowed else [])
    finally:
        server.stop()

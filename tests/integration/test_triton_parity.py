"""Triton's own example-client flows through tritonclient (in a subprocess): classification with
labels and reshape, model control, system shared memory, the server name."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import builders
from tests.conftest import RunningServer, approx_fp32

if importlib.util.find_spec("tritonclient") is None:
    pytest.skip(reason="tritonclient[grpc] is not installed (it is part of the test extra)", allow_module_level=True)

SCRIPT = Path(__file__).with_name("triton_parity_calls.py")


def run_calls(server: RunningServer, *scenarios: str, env: dict | None = None) -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT), server.address, *scenarios],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def triton_named(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("repo")
    builders.densenet_like(repo)
    builders.densenet_like(repo, "densenet_batched", batching=True)
    builders.add_sub(repo / "simple" / "1" / "model.onnx")
    server = RunningServer(repo, "--server-name", "triton")
    try:
        return run_calls(server, "classification")
    finally:
        server.stop()


def expected_top(image: np.ndarray, k: int) -> list[str]:
    scores = builders.DENSENET_WEIGHTS @ image.reshape(3, -1).mean(axis=1)
    order = np.argsort(-scores, kind="stable")[:k]
    return [f"{scores[i]:f}:{i}:CLASS_{i}" for i in order]


def test_server_name_flag(triton_named):
    assert triton_named["classification"]["server_name"] == "triton"  # simple_grpc_health_metadata.py checks it


def test_classification_with_labels_through_reshape(triton_named):
    found = triton_named["classification"]
    image = np.array(found["image"], np.float32)
    assert found["top3_shape"] == [3]
    got = [s.split(":") for s in found["top3"]]
    want = [s.split(":") for s in expected_top(image, 3)]
    # exact order: classes i and i + 7 share their weights, so tied scores are bit-equal and the stable sort
    # puts the lower index first (class 1 before 8 in this top 3), in numpy as in the server
    assert [(i, label) for _, i, label in got] == [(i, label) for _, i, label in want]
    # ONNX Runtime's pool and conv against numpy, each printed with "%f"
    assert [float(s) for s, _, _ in got] == approx_fp32([float(s) for s, _, _ in want])
    # without the parameter: the raw scores, in the config's dims (the model file's [1, 10, 1, 1] reshaped)
    assert found["raw_shape"] == [10] and found["metadata_shape"] == ["3", "4", "4"]


def test_classification_per_row_of_a_batching_model(triton_named):
    found = triton_named["classification"]
    batch = np.array(found["batch"], np.float32)
    assert len(found["batched"]) == 2
    for row, image in zip(found["batched"], batch):
        assert [s.split(":")[1:] for s in row] == [s.split(":")[1:] for s in expected_top(image, 2)]


def test_classification_count_must_be_positive(triton_named):
    bad = triton_named["classification"]["bad_k"]
    assert bad["status"] == "StatusCode.INVALID_ARGUMENT" and "classification" in bad["message"]


def test_model_control_explicit_mode_config_override_and_inline_files(tmp_path):
    repo = tmp_path / "repo"
    builders.add_sub(repo / "simple" / "1" / "model.onnx")
    builders.add_sub(repo / "later" / "1" / "model.onnx")
    inline = builders.add_sub(tmp_path / "outside" / "1" / "model.onnx")
    server_tmp = tmp_path / "server-tmp"  # the server's own TMPDIR: other processes' inline folders never show here
    server_tmp.mkdir()
    server = RunningServer(repo, "--model-control-mode", "explicit", "--load-model", "simple",
                           "--allow-model-upload", env={"TMPDIR": str(server_tmp)})  # the scenario uploads a model
    try:
        found = run_calls(server, "model_control", env={"INLINE_MODEL": str(inline)})["model_control"]
        assert not list(server_tmp.glob("ferry-inline-*/inline"))  # the inline folder went with the unload
    finally:
        server.stop()
    assert found["ready_at_start"] == {"simple": True, "later": False}  # explicit: only --load-model
    assert found["bad_config"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "failed to load" in found["bad_config"]["message"]  # the words the example client looks for
    assert found["overridden_max_batch_size"] == 16  # the config parameter replaced the folder's
    assert found["ready_after_unload"] is False and found["later_ready"] is True
    assert found["inline_sum_ok"] and found["inline_ready_after_unload"] is False
    assert "failed to load" in found["unknown"]["message"] and found["unknown"]["status"] == "StatusCode.NOT_FOUND"
    for key in ("long_path", "escaping_path"):
        assert found[key]["status"] == "StatusCode.INVALID_ARGUMENT", key
        assert "failed to poll from model repository" in found[key]["message"]
    assert found["live"]


@pytest.mark.parametrize("mode", ["none", "poll"])
def test_model_control_refused_outside_explicit_mode(tmp_path, mode):
    builders.add_sub(tmp_path / "simple" / "1" / "model.onnx")
    server = RunningServer(tmp_path, "--model-control-mode", mode)
    try:
        found = run_calls(server, "control_refused")["control_refused"]
    finally:
        server.stop()
    for call in ("load", "unload"):
        assert found[call]["status"] == "StatusCode.UNAVAILABLE"
        assert "explicit model load / unload is not allowed" in found[call]["message"]
        assert "--model-control-mode explicit" in found[call]["message"]


def mapped(pid: int, tag: str) -> set[str]:
    """The shared memory objects of this test that the server process has mapped now."""
    text = Path(f"/proc/{pid}/maps").read_text()
    return {line.split(f"/dev/shm/{tag}_")[1].split()[0] for line in text.splitlines() if f"/dev/shm/{tag}_" in line}


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="system shared memory needs /dev/shm")
def test_system_shared_memory_register_infer_status_unregister(tmp_path):
    builders.add_sub(tmp_path / "simple" / "1" / "model.onnx")
    skip = tuple(t for t in builders.ONNX_TYPES if t != "BYTES")
    builders.identity_all_types(tmp_path / "strings" / "1" / "model.onnx", skip=skip)
    tag = f"ferry_shm_{os.getpid()}"
    server = RunningServer(tmp_path, "--allow-shared-memory")  # registering regions: off by default
    try:
        found = run_calls(server, "shared_memory", env={"SHM_TAG": tag})["shared_memory"]
        held = mapped(server.proc.pid, tag)
        cleared = run_calls(server, "shared_memory_clear")["shared_memory_clear"]
        after_clear = mapped(server.proc.pid, tag)
    finally:
        server.stop()
    a, b = np.arange(16, dtype=np.float32).reshape(4, 4), np.full((4, 4), 0.5, np.float32)
    assert found["OUTPUT0"] == {"values": (a + b).tolist(), "region": "output_data", "byte_size": 64, "raw": 0}
    assert found["OUTPUT1"] == {"values": (a - b).tolist(), "region": "output_data", "byte_size": 64, "raw": 0}
    assert found["mixed_output0"] == (a + 4 * b).tolist() and found["mixed_output1"] == (a - 4 * b).tolist()
    assert found["strings"] == ["shared", "", "memory"] and found["strings_byte_size"] == 4 * 3 + 12
    assert [(r["name"], r["key"], r["byte_size"]) for r in found["status"]] == [
        (n, f"/{tag}_{n}", str(size)) for n, size in
        (("input_data", 128), ("kept", 128), ("output_data", 128), ("str_in", 64), ("str_out", 64))]
    assert list(found["one_status"]["regions"]) == ["kept"]
    errors = found["errors"]
    expected = {
        "twice": ("ALREADY_EXISTS", "shared memory region 'kept' already in manager"),
        "no_key": ("NOT_FOUND", f"Unable to open shared memory region: '/{tag}_never_created'"),
        "past_object": ("INVALID_ARGUMENT", "failed to register shared memory region 'past': invalid args"),
        "too_small": ("INVALID_ARGUMENT", "output 'OUTPUT0' (16 bytes) should be at least 64 bytes"),
        "offset": ("INVALID_ARGUMENT", "Invalid offset for shared memory region: 'input_data'"),
        "offset_size": ("INVALID_ARGUMENT", "Invalid offset + byte size for shared memory region: 'input_data'"),
        "unknown_status": ("NOT_FOUND", "Unable to find system shared memory region: 'nope'"),
        "unregistered": ("NOT_FOUND", "Unable to find shared memory region: 'input_data'"),
        "cuda": ("NOT_FOUND", "Unable to find cuda shared memory region: 'c'"),
        "cuda_register": ("UNIMPLEMENTED", "CudaSharedMemoryRegister: CUDA shared memory is not implemented by Ferry"),
    }
    for key, (status, words) in expected.items():
        assert errors[key]["status"] == f"StatusCode.{status}", (key, errors[key])
        assert words in errors[key]["message"], (key, errors[key])
    assert "SystemSharedMemoryRegister" in errors["unregistered"]["message"]  # says what to do
    assert "system_shared_memory" in found["extensions"]
    assert found["cuda_status"] == {}  # no CUDA region is ever registered: clearing and status succeed, empty
    assert found["status_left"] == ["kept"] and held == {"kept"}  # unregistered regions are unmapped
    assert cleared["status_left"] == [] and after_clear == set()  # unregister-all

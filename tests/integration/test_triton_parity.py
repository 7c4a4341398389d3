"""Triton's own example-client flows through tritonclient (in a subprocess): classification with
labels and reshape, model control, system shared memory, the server name."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import builders
from tests.conftest import RunningServer

if importlib.util.find_spec("tritonclient") is None:
    pytest.skip(reason="tritonclient[grpc] is not installed (it is part of the test extra)", allow_module_level=True)

SCRIPT = Path(__file__).with_name("triton_parity_calls.py")


def run_calls(server: RunningServer, *scenarios: str) -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT), server.address, *scenarios],
                          capture_output=True, text=True, timeout=120)
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
    assert [(i, label) for _, i, label in got] == [(i, label) for _, i, label in want]
    assert [float(s) for s, _, _ in got] == pytest.approx([float(s) for s, _, _ in want], abs=1e-5)
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

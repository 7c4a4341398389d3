"""Triton's classification extension over HTTP (image_client.py -i http -c N): the same answer as over gRPC,
through the one implementation both doors call (doors.shared.class_counts / classified)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import builders
from tests.conftest import RunningServer

if importlib.util.find_spec("tritonclient") is None:
    pytest.skip(reason="tritonclient[grpc,http] is not installed (it is part of the test extra)", allow_module_level=True)


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("repo")
    builders.densenet_like(repo)
    builders.densenet_like(repo, "densenet_batched", batching=True)
    server = RunningServer(repo)
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("http_classification_calls.py")),
                               server.address, server.http_address], capture_output=True, text=True, timeout=120)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("case, shape", [("top3", [3]), ("batched_top2", [2, 2]), ("all", [10])])
def test_http_classes_equal_grpc_classes(answers, case, shape):
    found = answers[case]
    assert "error" not in found["grpc"], found["grpc"]
    assert found["grpc"]["shape"] == shape
    assert all(c.count(":") == 2 and c.split(":")[2].startswith("CLASS_") for c in found["grpc"]["classes"])
    assert found["http_binary"] == found["grpc"]  # the same strings, in the same order, in the same shape
    assert found["http_json"] == found["grpc"]


def test_a_bad_class_count_is_refused_alike(answers):
    negative = answers["negative"]
    assert negative["grpc"]["status"] == "StatusCode.INVALID_ARGUMENT" and negative["http_binary"]["status"] == "400"
    assert negative["http_binary"]["error"] == negative["grpc"]["error"]
    assert "classification" in negative["grpc"]["error"] and "positive integer" in negative["grpc"]["error"]
    zero = answers["zero"]["http_json"]
    assert zero["status"] == 400 and "positive integer" in zero["body"]["error"], zero

"""Stateful and composed models through NVIDIA's tritonclient (in a subprocess): ensembles, a decoupled
repeat model, and true batching in the python backend."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import model_kinds
from tests.conftest import RunningServer, link_shipped_models

if importlib.util.find_spec("tritonclient") is None:
    pytest.skip(reason="tritonclient[grpc] is not installed (it is part of the test extra)", allow_module_level=True)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple", "preprocess", "postprocess", "pipeline", "repeat_int32")
    model_kinds.chain(repo)
    model_kinds.rows(repo)
    server = RunningServer(repo)
    try:
        script = Path(__file__).with_name("model_kinds_calls.py")
        done = subprocess.run([sys.executable, str(script), server.address], capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)
    finally:
        server.stop()


def test_three_step_ensemble_equals_its_steps_run_one_by_one(result):
    found = result["ensembles"]
    assert found["pipeline_equals_steps"] and found["pipeline_shape"] == [2, 16]
    assert found["chain"] == found["chain_expected"]
    assert found["metadata_platform"] == "ensemble"


def test_failing_middle_step_is_named_and_fails_only_its_request(result):
    failing = result["ensembles"]["failing_step"]
    assert failing["status"] == "StatusCode.INTERNAL"  # the model raised, as Triton reports a model failure
    assert "ensemble 'chain' step 1 (model 'fragile_triple')" in failing["message"]
    assert "negative input" in failing["message"]
    assert result["ensembles"]["chain_after_failure"] == result["ensembles"]["chain_expected"]


def test_decoupled_repeat_streams_one_response_per_element_then_final(result):
    responses = result["repeat"]["responses"]
    assert responses["r4"] == [{"final": False, "out": v, "idx": i} for i, v in enumerate([4, 5, 6, 7])] + [
        {"final": True, "outputs": 0}]
    assert responses["r1"] == [{"final": False, "out": 9, "idx": 0}, {"final": True, "outputs": 0}]


def test_model_infer_refuses_a_decoupled_model(result):
    refused = result["repeat"]["infer_error"]
    assert refused["status"] == "StatusCode.UNIMPLEMENTED"
    assert "decoupled" in refused["message"] and "ModelStreamInfer" in refused["message"]


def test_python_model_receives_one_batched_array_per_call(result):
    found = result["batching"]
    assert found["rows_seen"] == [4, 4, 4, 4]  # each request's answer came from a call over 4 rows
    assert found["outputs"] == [0.0, 2.0, 4.0, 6.0]  # and each row got its own answer back
    assert (found["execution_count"], found["inference_count"]) == (1, 4)

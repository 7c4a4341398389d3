"""Stateful and composed models through NVIDIA's tritonclient (in a subprocess): ensembles, a decoupled
repeat model, true batching in the python backend, and sequence batching (state, strategies, ids)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests import kserve, model_kinds
from tests.conftest import RunningServer, link_shipped_models

if importlib.util.find_spec("tritonclient") is None:
    pytest.skip(reason="tritonclient[grpc] is not installed (it is part of the test extra)", allow_module_level=True)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple", "preprocess", "postprocess", "pipeline", "repeat_int32")
    model_kinds.chain(repo)
    model_kinds.rows(repo)
    # A round's two requests fill a batch of 2; the long window makes sure they always meet.
    model_kinds.accumulate(repo, "acc_direct", "direct: {max_queue_delay_microseconds: 30000000}")
    model_kinds.accumulate(repo, "acc_oldest", "oldest: {max_candidate_sequences: 4, max_queue_delay_microseconds: 30000000}")
    model_kinds.accumulate(repo, "acc_string", "direct: {}", corrid="TYPE_STRING")
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


@pytest.mark.parametrize("strategy", ["direct", "oldest"])
def test_interleaved_sequences_keep_their_own_state_and_batch_together(result, strategy):
    found = result[strategy]
    assert found["answers"] == {"1001": [1, 3, 6, 10], "1002": [10, 30, 60, 100]}  # running sums, per sequence
    assert (found["execution_count"], found["inference_count"]) == (4, 8)  # each round: both sequences, one call
    assert found["batch_sizes"] == [2]


def test_string_correlation_ids(result):
    found = result["string_ids"]
    assert found["answers"] == {"alpha": [[5, "alpha"], [11, "alpha"]], "beta": [[100, "beta"], [101, "beta"]]}
    assert found["no_start"]["status"] == "StatusCode.INVALID_ARGUMENT" and "START" in found["no_start"]["message"]
    assert found["no_id"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "correlation ID" in found["no_id"]["message"]


def test_idle_sequence_is_released_after_the_timeout(tmp_path):
    model_kinds.accumulate(tmp_path, "acc", "direct: {}", idle_us=200_000)
    server = RunningServer(tmp_path)
    try:
        def send(value, start=False):
            request = kserve.request("acc", {"INPUT": np.array([[value]], np.int32)})
            request.parameters["sequence_id"].uint64_param = 2**63 + 5  # beyond int64: a uint64 id
            request.parameters["sequence_start"].bool_param = start
            return kserve.stub(server.channel).ModelInfer(request, timeout=30)

        assert kserve.outputs(send(4, start=True))["OUTPUT"].tolist() == [[4]]
        deadline = time.monotonic() + 30  # waits for the server's own report, not for the clock
        while "released after" not in server.output:
            assert time.monotonic() < deadline, server.output
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as refused:
            send(1)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "START" in refused.value.details()
        assert kserve.outputs(send(2, start=True))["OUTPUT"].tolist() == [[2]]  # a fresh sequence, fresh state
    finally:
        server.stop()


def test_a_sequence_that_finds_every_slot_taken_waits_in_the_backlog(tmp_path):
    """One slot (oldest, max_candidate_sequences 1): a second sequence's START waits, first come first
    served, until the first sequence ends; a third that gives up (its deadline) leaves no trace."""
    model_kinds.accumulate(tmp_path, "one", "oldest: {max_candidate_sequences: 1}")
    server = RunningServer(tmp_path)
    stub = kserve.stub(server.channel)

    def request(cid: int, value: int, start=False, end=False):
        r = kserve.request("one", {"INPUT": np.array([[value]], np.int32)})
        r.parameters["sequence_id"].uint64_param = cid
        r.parameters["sequence_start"].bool_param = start
        r.parameters["sequence_end"].bool_param = end
        return r

    def waiting(count: int) -> None:
        deadline = time.monotonic() + 30  # the server's own report that the START is in the backlog
        while f"waits for a sequence slot ({count} waiting)" not in server.output:
            assert time.monotonic() < deadline, server.output
            time.sleep(0.02)

    try:
        assert kserve.outputs(stub.ModelInfer(request(1, 5, start=True), timeout=30))["OUTPUT"].tolist() == [[5]]
        second = stub.ModelInfer.future(request(2, 7, start=True), timeout=60)
        waiting(1)
        with pytest.raises(grpc.RpcError) as gave_up:  # waits behind the second, and its deadline passes first
            stub.ModelInfer(request(3, 1, start=True), timeout=1)
        assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not second.done()  # still waiting: sequence 1 holds the only slot
        assert kserve.outputs(stub.ModelInfer(request(1, 2, end=True), timeout=30))["OUTPUT"].tolist() == [[7]]
        assert kserve.outputs(second.result())["OUTPUT"].tolist() == [[7]]  # its own state, from zero
        assert kserve.outputs(stub.ModelInfer(request(2, 3, end=True), timeout=30))["OUTPUT"].tolist() == [[10]]
        # the one that gave up holds nothing: a new sequence gets the free slot at once
        assert kserve.outputs(stub.ModelInfer(request(4, 9, start=True), timeout=30))["OUTPUT"].tolist() == [[9]]
    finally:
        server.stop()

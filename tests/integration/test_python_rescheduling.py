"""Triton's request rescheduling (`set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)` under
`sequence_batching { iterative_sequence: true }`), with NVIDIA's tritonclient in a subprocess: a
rescheduled request runs again, batched with what waits, until the model answers it; a decoupled one
streams until its final response; a model that may not reschedule is refused with Triton's message;
a sequence model's Python code sees the client's correlation id and flags; and, as in Triton, a
decoupled model's instance takes its next request once execute returns, while the responses of the
one before still come from a thread of the model's."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve, python_rescheduling_models
from tests.conftest import RunningServer

if importlib.util.find_spec("tritonclient") is None:  # never imported here: its protobufs clash with ours
    pytest.skip(reason="tritonclient[grpc] is not installed (test extra)", allow_module_level=True)

SCRIPT = Path(__file__).with_name("python_rescheduling_calls.py")
START = 1  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
END = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    gate, entered = repo.parent / "steps.gate", repo.parent / "steps.entered"
    python_rescheduling_models.build(repo, gate, entered)
    server = RunningServer(repo)
    try:
        done = subprocess.run([sys.executable, str(SCRIPT), server.address, server.http_address, server.metrics_url,
                               str(gate), str(entered)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        yield server, json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        gate.touch()  # whatever failed, nothing stays held
        server.stop()


def test_a_rescheduled_request_runs_again_until_the_model_answers_it(served):
    _, out = served
    steps = out["steps"]
    assert {key: steps[key]["RUNS"] for key in "abc"} == {"a": 3, "b": 2, "c": 4}
    for key in "abc":  # START on its first run only: each request is a sequence of its own
        assert steps[key]["FLAGS"] == [START] + [0] * (steps[key]["RUNS"] - 1)
    assert len({steps[key]["CID"] for key in "abc"}) == 3 and all(steps[key]["CID"] > 0 for key in "abc")
    # B and C queued while A's first run held the instance; A, rescheduled, went back into the queue before
    # the instance took its next batch, so the three ran together from then on (continuous batching)
    assert {key: steps[key]["BATCH"] for key in "abc"} == {"a": 3, "b": 3, "c": 3}
    assert out["steps_again"] == [[5]]  # the instance keeps serving; the earlier sequences left no state behind


def test_a_decoupled_request_streams_until_its_final_response_across_its_runs(served):
    _, out = served
    assert out["count"]["errors"] == []
    assert out["count"]["out"] == {"three": [[2, START], [1, 0], [0, 0]], "two": [[1, START], [0, 0]]}
    assert [event["OUT"] for event in out["generate_stream"]] == [1, 0]  # Triton's HTTP generate_stream too


def test_a_model_that_may_not_reschedule_is_refused_with_tritons_message_and_keeps_serving(served):
    _, out = served
    refused = out["refused"]
    assert refused["status"] == "StatusCode.UNIMPLEMENTED"
    assert "Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE" in refused["message"]
    assert "iterative_sequence: true" in refused["message"]
    assert out["plain_after"] == [[8]]
    stream = out["refused_stream"]  # decoupled: what it sent arrives, then the refusal ends the stream
    assert stream["out"] == [[-6]] and len(stream["errors"]) == 1
    assert "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE" in stream["errors"][0]


def test_a_sequence_models_python_code_sees_the_clients_correlation_id_and_flags(served):
    _, out = served
    assert out["sequence"] == [[42, START, 1], [42, 0, 2], [42, END, 3]]


def test_a_decoupled_instance_runs_its_next_request_once_execute_returns(served):
    _, out = served
    threaded = out["threaded"]
    assert threaded["errors"] == []
    # A's thread was released by B, which ran while A's stream was still open: 2, not -1 after 60 s
    assert threaded["out"] == {"a": [0, 2], "b": [1]}


def test_a_decoupled_async_execute_lets_the_next_request_start_while_it_awaits(served):
    _, out = served
    assert out["async"]["errors"] == []
    assert out["async"]["out"] == {"a": [0, 2], "b": [1]}  # B's execute ran while A's awaited


def test_iterative_sequence_is_refused_for_a_model_that_cannot_reschedule(tmp_path):
    repo = tmp_path / "repo"
    builders.add_sub(repo / "onnx_iter" / "1" / "model.onnx")
    (repo / "onnx_iter" / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 4\n'
                                                      "sequence_batching { iterative_sequence: true }\n")
    server = RunningServer(repo)
    try:
        index = kserve.stub(server.channel).RepositoryIndex(pb.RepositoryIndexRequest())
        model = next(m for m in index.models if m.name == "onnx_iter")
        assert model.state == "UNAVAILABLE" and "iterative_sequence needs a model that reschedules" in model.reason
        with pytest.raises(grpc.RpcError):
            kserve.infer(server.channel, "onnx_iter", {"INPUT0": np.ones((1, 4), np.float32)})
    finally:
        server.stop()

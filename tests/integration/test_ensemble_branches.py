"""Ensembles whose steps fork: independent steps run at the same time, and a failing branch fails the
request at once, cancelling its sibling.

The branch models hold their executions at gate files the test opens (tests/builders.gated_model), so
"both branches are running" and "the sibling is still held" are states the test controls and reads
from the server's statistics, never timing guesses.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve, model_kinds
from tests.conftest import RunningServer, wait_for

HOLD = np.array([[-1, -2]], np.float32)  # negative: the gated models hold it, the fragile model raises
GO = np.array([[1, 2]], np.float32)

SUM_MODEL = '''
import numpy as np


class Model:
    def execute(self, inputs):
        return {"Y": (inputs["A"] + inputs["B"]).astype(np.float32)}
'''

FRAGILE_MODEL = model_kinds.STEP_MODEL.format(expression="x * 3", fail_negative=True)

SUM_CONFIG = """
backend: python
max_batch_size: 8
input: [{name: A, data_type: TYPE_FP32, dims: [2]}, {name: B, data_type: TYPE_FP32, dims: [2]}]
output: [{name: Y, data_type: TYPE_FP32, dims: [2]}]
dynamic_batching: {}
"""

FRAGILE_CONFIG = model_kinds.STEP_CONFIG.replace("dims: [4]", "dims: [2]")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for name in ("left", "right", "held", "first", "second"):
        builders.gated_model(repo, name, "dynamic_batching: {}\n", gate=repo / f"{name}.gate")
    model_kinds.python_model(repo, "sum", SUM_MODEL, SUM_CONFIG)
    model_kinds.python_model(repo, "fragile", FRAGILE_MODEL, FRAGILE_CONFIG)
    # fork: X -> left -> l, X -> right -> r, then sum(l, r) -> S
    model_kinds.ensemble(repo, "fork", [("left", {"X": "X"}, "l"), ("right", {"X": "X"}, "r"),
                            ("sum", {"A": "l", "B": "r"}, "S")], "S")
    # fork_fail: X -> held -> h (held at its gate), X -> fragile -> f (raises on a negative value), sum -> S
    model_kinds.ensemble(repo, "fork_fail", [("held", {"X": "X"}, "h"), ("fragile", {"X": "X"}, "f"),
                                 ("sum", {"A": "h", "B": "f"}, "S")], "S")
    # pair: X -> first -> a, X -> second -> b, answering both
    model_kinds.ensemble(repo, "pair", [("first", {"X": "X"}, "a"), ("second", {"X": "X"}, "b")], "a")
    running = RunningServer(repo)
    running.repo = repo
    yield running
    running.stop()


def stats(server, model: str) -> pb.ModelStatistics:
    return kserve.stub(server.channel).ModelStatistics(pb.ModelStatisticsRequest(name=model)).model_stats[0]


def test_independent_steps_run_at_the_same_time(server):
    repo = server.repo
    call = kserve.stub(server.channel).ModelInfer.future(kserve.request("fork", {"X": HOLD}), timeout=120)
    wait_for(lambda: all((repo / f"{m}.gate.running").exists() for m in ("left", "right")),
             what="both branches of the fork to be executing")
    # Both are held at their gates at once: run one after the other, `left` would have finished first.
    assert stats(server, "left").inference_stats.success.count == 0
    assert stats(server, "sum").execution_count == 0  # the join waits for both branches
    for m in ("left", "right"):
        (repo / f"{m}.gate").touch()
    assert kserve.outputs(call.result())["S"].tolist() == (2 * HOLD).tolist()
    assert stats(server, "sum").execution_count == 1


def test_a_failing_branch_fails_the_request_at_once_and_cancels_its_sibling(server):
    repo = server.repo
    joined = stats(server, "sum").execution_count
    call = kserve.stub(server.channel).ModelInfer.future(kserve.request("fork_fail", {"X": HOLD}), timeout=120)
    with pytest.raises(grpc.RpcError) as info:
        call.result()
    details = info.value.details()
    assert "ensemble 'fork_fail' step 1 (model 'fragile')" in details and "negative input" in details, details
    # Answered while its sibling still holds at its gate (not opened yet): one after the other, the
    # sibling would have had to finish first. The sibling's step request was cancelled, queued or running.
    assert stats(server, "held").inference_stats.success.count == 0
    server.wait_for_metric("nv_inference_request_failure", 1, model="held", reason="CANCELED")
    assert stats(server, "sum").execution_count == joined  # nothing joined
    (repo / "held.gate").touch()
    # The server goes on serving the same ensemble; the cancelled step's answer, if it ran, was dropped.
    assert kserve.outputs(kserve.stub(server.channel).ModelInfer(
        kserve.request("fork_fail", {"X": GO}), timeout=60))["S"].tolist() == (GO + 3 * GO).tolist()
    assert stats(server, "held").inference_stats.success.count == 1


def test_a_cancelled_call_cancels_every_running_step(server):
    repo = server.repo
    call = kserve.stub(server.channel).ModelInfer.future(kserve.request("pair", {"X": HOLD}), timeout=120)
    wait_for(lambda: all((repo / f"{m}.gate.running").exists() for m in ("first", "second")),
             what="both steps to be executing")
    call.cancel()
    server.wait_for_metric("nv_inference_request_failure", 1, model="pair", reason="CANCELED")
    for m in ("first", "second"):  # each step's request left its model, counted as the caller's cancel
        server.wait_for_metric("nv_inference_request_failure", 1, model=m, reason="CANCELED")
        (repo / f"{m}.gate").touch()
    assert kserve.outputs(kserve.stub(server.channel).ModelInfer(
        kserve.request("pair", {"X": GO}), timeout=60))["a"].tolist() == GO.tolist()

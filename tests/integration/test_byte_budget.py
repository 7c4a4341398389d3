"""Memory bounded in bytes: beyond a model's (or the server's) queued-bytes budget, requests are refused
UNAVAILABLE at once, like a full queue, and the bytes come back as requests are answered."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from tests import builders, kserve
from tests.conftest import RunningServer

HOLD = {"X": np.full((1, 2), -1, np.float32)}  # a negative value: the gated model waits for the gate
PASS = {"X": np.ones((1, 2), np.float32)}
REQUEST_BYTES = 8  # one [1, 2] FP32 input, sent as raw contents
ADMITTED = 3  # the budget holds exactly this many requests


def wait_for(predicate, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("flags, named", [
    (("--max-model-queued-bytes", str(ADMITTED * REQUEST_BYTES)), "model 'gated' version 1"),
    (("--max-queued-bytes", str(ADMITTED * REQUEST_BYTES), "--max-model-queued-bytes", "0"), "the server"),
])
def test_a_full_byte_budget_refuses_unavailable_and_frees_as_requests_are_answered(tmp_path, flags, named):
    gate = tmp_path / "gate"
    builders.gated_model(tmp_path / "repo", "gated", gate=gate, max_batch_size=1)
    server = RunningServer(tmp_path / "repo", *flags)
    try:
        stub = kserve.stub(server.channel)
        held = stub.ModelInfer.future(kserve.request("gated", HOLD), timeout=120)
        wait_for(lambda: (tmp_path / "gate.running").exists(), "the first execution to hold the instance")
        queued = [stub.ModelInfer.future(kserve.request("gated", PASS), timeout=120) for _ in range(ADMITTED - 1)]
        server.wait_for_metric("ferry_queued_bytes", ADMITTED * REQUEST_BYTES, timeout_s=60, model="gated")
        assert server.metric("ferry_server_queued_bytes") == ADMITTED * REQUEST_BYTES

        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(kserve.request("gated", PASS), timeout=60)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert named in refused.value.details() and "retry later" in refused.value.details()
        assert server.metric("ferry_queued_bytes", model="gated") == ADMITTED * REQUEST_BYTES  # refusal holds nothing

        gate.touch()
        for call in [held, *queued]:
            assert kserve.outputs(call.result()).keys() >= {"Y"}
        server.wait_for_metric("ferry_queued_bytes", 0, timeout_s=60, model="gated")
        assert server.metric("ferry_server_queued_bytes") == 0
        again = kserve.outputs(stub.ModelInfer(kserve.request("gated", PASS), timeout=60))
        np.testing.assert_array_equal(again["Y"], PASS["X"])
        failures = server.metric("nv_inference_request_failure", model="gated", reason="REJECTED")
        assert failures == 1
    finally:
        gate.touch()
        server.stop()


def test_answered_errors_and_cancelled_callers_give_their_bytes_back(tmp_path):
    gate = tmp_path / "gate"
    builders.gated_model(tmp_path / "repo", "gated", gate=gate, max_batch_size=1)
    server = RunningServer(tmp_path / "repo", "--max-model-queued-bytes", str(ADMITTED * REQUEST_BYTES))
    try:
        stub = kserve.stub(server.channel)
        held = stub.ModelInfer.future(kserve.request("gated", HOLD), timeout=120)
        wait_for(lambda: (tmp_path / "gate.running").exists(), "the first execution to hold the instance")
        gone = [stub.ModelInfer.future(kserve.request("gated", PASS), timeout=120) for _ in range(ADMITTED - 1)]
        server.wait_for_metric("ferry_queued_bytes", ADMITTED * REQUEST_BYTES, timeout_s=60, model="gated")
        for call in gone:
            call.cancel()
        server.wait_for_metric("ferry_queued_bytes", REQUEST_BYTES, timeout_s=60, model="gated")
        with pytest.raises(grpc.RpcError) as bad:  # refused at decode: never charged
            stub.ModelInfer(kserve.request("gated", {"X": np.ones((1, 3), np.float32)}), timeout=60)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        gate.touch()
        held.result()
        server.wait_for_metric("ferry_queued_bytes", 0, timeout_s=60, model="gated")
    finally:
        gate.touch()
        server.stop()

"""Requests whose clients leave before the answer: each is counted once, with its reason, and the
statistics' fail count equals the sum of nv_inference_request_failure over its reasons (as Triton's)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer, link_shipped_models, wait_for

HOLD = np.array([[-1, -1]], np.float32)  # the gated model holds executions with a negative value
REASONS = ("REJECTED", "BACKEND", "CANCELED", "OTHER")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    gate = repo / "open"
    builders.gated_model(repo, "gated", gate=gate, extra_yaml="dynamic_batching: {}\n")
    link_shipped_models(repo, "repeat_int32")
    server = RunningServer(repo)
    yield server, gate
    gate.touch()
    server.stop()


def fail_count(server, model) -> int:
    stats = kserve.stub(server.channel).ModelStatistics(pb.ModelStatisticsRequest(name=model)).model_stats
    return stats[0].inference_stats.fail.count


def failures(server, model) -> dict[str, float]:
    return {r: server.metric("nv_inference_request_failure", model=model, reason=r) for r in REASONS}


def test_clients_that_close_their_channel_are_counted_once_in_both_views(env):
    server, gate = env
    held = kserve.stub(server.channel).ModelInfer.future(kserve.request("gated", {"X": HOLD}), timeout=120)
    wait_for(lambda: (gate.parent / "open.running").exists(), what="the held execution to start")
    channels = [grpc.insecure_channel(server.address) for _ in range(12)]
    calls = [kserve.stub(c).ModelInfer.future(kserve.request("gated", {"X": np.ones((1, 2), np.float32)}), timeout=120)
             for c in channels]
    server.wait_for_metric("nv_inference_pending_request_count", 12, timeout_s=60, model="gated")
    for channel in channels:  # the clients go away before their answers
        channel.close()
    server.wait_for_metric("nv_inference_request_failure", 12, timeout_s=60, model="gated", reason="CANCELED")
    gate.touch()
    held.result()
    assert all(call.done() for call in calls)
    counted = failures(server, "gated")
    assert counted == {"REJECTED": 0, "BACKEND": 0, "CANCELED": 12, "OTHER": 0}
    assert fail_count(server, "gated") == sum(counted.values())


def test_a_decoupled_stream_whose_client_leaves_is_counted_canceled(env):
    server, _ = env
    request = kserve.request("repeat_int32", {"IN": np.array([1, 2, 3], np.int32),
                                              "DELAY": np.array([0, 15_000, 0], np.uint32),
                                              "WAIT": np.array([0], np.uint32)}, request_id="leaves")
    call = kserve.stub(server.channel).ModelStreamInfer(iter([request]), timeout=120)
    first = next(call)  # the first response, then the model waits 15 s before the second
    assert not first.error_message and first.infer_response.id == "leaves"
    call.cancel()
    server.wait_for_metric("nv_inference_request_failure", 1, timeout_s=60, model="repeat_int32", reason="CANCELED")
    counted = failures(server, "repeat_int32")
    assert counted == {"REJECTED": 0, "BACKEND": 0, "CANCELED": 1, "OTHER": 0}
    assert fail_count(server, "repeat_int32") == 1

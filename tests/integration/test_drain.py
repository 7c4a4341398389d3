"""Drain keeps its promise (issue 18, row 9): on SIGTERM every call is answered OK or UNAVAILABLE, none
CANCELLED, none left hanging; behind gRPC's round_robin with retries, a replica can leave under load
without one failed request.

Work is held by a gated python model (executions wait for a file the test creates), so no outcome
depends on how long anything takes: the queued requests cannot finish within a short grace whatever the
machine's speed, and with a long grace the draining server cannot exit before the test opens the gate.
"""

from __future__ import annotations

import json
import threading

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer, link_shipped_models, wait_for

HOLD = {"X": np.array([[-1, -1]], np.float32)}  # negative: the gated model waits for the gate file
QUEUED = 40


def health_status(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _hold_queue(tmp_path, grace_s: str):
    """A server whose gated model holds one execution with QUEUED - 1 requests queued behind it."""
    gate = tmp_path / "gate"
    builders.gated_model(tmp_path / "repo", "gated", gate=gate, max_batch_size=1)
    server = RunningServer(tmp_path / "repo", "--drain-grace-seconds", grace_s)
    stub = kserve.stub(server.channel)
    calls = [stub.ModelInfer.future(kserve.request("gated", HOLD), timeout=120) for _ in range(QUEUED)]
    wait_for(lambda: (tmp_path / "gate.running").exists(), what="the first execution to start")
    server.wait_for_metric("nv_inference_pending_request_count", QUEUED - 1, timeout_s=60, model="gated")
    return server, stub, calls, gate


def test_sigterm_answers_queued_and_held_requests_unavailable_never_cancelled_and_exits(tmp_path):
    """The held execution never returns (its gate stays shut): the grace runs out, every call is answered
    UNAVAILABLE, and the server still exits, since the model's process is ended after the grace."""
    server, _, calls, gate = _hold_queue(tmp_path, "0.5")
    try:
        server.proc.send_signal(__import__("signal").SIGTERM)
        codes = [_code(call) for call in calls]  # each waits at most its 120 s deadline: none may hang
        assert grpc.StatusCode.CANCELLED not in codes
        assert grpc.StatusCode.DEADLINE_EXCEEDED not in codes, "a request was left hanging by the drain"
        assert codes.count(grpc.StatusCode.UNAVAILABLE) == QUEUED  # the gate is shut: none could finish
        assert server.proc.wait(60) == 0  # the hung model did not keep the server alive
    finally:
        gate.touch()
    assert "ferry: stopped" in server.output


def test_while_draining_probes_answer_and_new_calls_are_refused_then_admitted_work_finishes(tmp_path):
    """A grace long enough for anything: the held execution keeps the drain open until the test opens
    the gate, so what a draining server answers is checked without racing its grace."""
    server, stub, calls, gate = _hold_queue(tmp_path, "120")
    try:
        server.proc.send_signal(__import__("signal").SIGTERM)
        wait_for(lambda: health_status(server.channel) == health_pb2.HealthCheckResponse.NOT_SERVING,
                 what="the server to report NOT_SERVING")
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live
        assert not stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
        for call in (lambda: stub.ModelInfer(kserve.request("gated", {"X": np.ones((1, 2), np.float32)}), timeout=10),
                     lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="gated"), timeout=10)):
            try:
                call()
                raise AssertionError("a call after SIGTERM was served")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                assert "shutting down" in err.details()
        assert server.proc.poll() is None
    finally:
        gate.touch()
    codes = [_code(call) for call in calls]
    assert codes == [grpc.StatusCode.OK] * QUEUED  # admitted before SIGTERM: all answered within the grace
    assert server.stop() == 0
    assert "ferry: stopped" in server.output


def _code(call) -> grpc.StatusCode:
    try:
        call.result()
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


SERVICE_CONFIG = json.dumps({
    "loadBalancingConfig": [{"round_robin": {}}],
    "healthCheckConfig": {"serviceName": ""},  # leave a replica as soon as it reports NOT_SERVING
    "methodConfig": [{"name": [{"service": "inference.GRPCInferenceService"}],
                      "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.01s", "maxBackoff": "0.2s",
                                      "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}],
})
CLIENTS, PER_CLIENT, SIGTERM_AFTER = 32, 60, 320


def test_one_of_three_replicas_leaves_under_load_without_a_failed_request(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    link_shipped_models(repo, "simple")
    replicas = [RunningServer(repo, "--drain-grace-seconds", "30") for _ in range(3)]
    target = "ipv4:" + ",".join(r.address for r in replicas)
    channel = grpc.insecure_channel(target, options=[("grpc.service_config", SERVICE_CONFIG),
                                                     ("grpc.enable_retries", 1)])
    stub = kserve.stub(channel)
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    request = kserve.request("simple", {"INPUT0": a, "INPUT1": np.ones_like(a)})
    done, failures, lock = [0], [], threading.Lock()
    after_sigterm = [0]
    terminated = threading.Event()

    def client() -> None:
        for _ in range(PER_CLIENT):
            try:
                stub.ModelInfer(request, timeout=60)
            except grpc.RpcError as err:
                with lock:
                    failures.append((err.code(), err.details()))
            with lock:
                done[0] += 1
                after_sigterm[0] += terminated.is_set()

    try:
        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        wait_for(lambda: done[0] >= SIGTERM_AFTER, what="load to build up")
        replicas[0].proc.send_signal(__import__("signal").SIGTERM)
        terminated.set()
        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads), "a client was left hanging"
        assert failures == []
        assert done[0] == CLIENTS * PER_CLIENT
        assert after_sigterm[0] > 0  # the replica left while the load went on
        assert replicas[0].proc.wait(60) == 0
    finally:
        channel.close()
        for r in replicas:
            r.stop()

"""Deadlines, admission, cancellation, priorities, ordering and instances, over gRPC.

Models here are python-backend models whose executions hold at a gate file until the test opens it,
so "while the instance is busy" is a state the test controls, not a timing guess.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer, wait_for

HOLD = np.array([[-1, -1]], np.float32)  # executions with a negative value wait for the gate
GO = np.array([[1, 2]], np.float32)


class Gate:
    def __init__(self, path: Path):
        self.path = path

    def wait_running(self, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while not Path(str(self.path) + ".running").exists():
            assert time.monotonic() < deadline, "the held execution never started"
            time.sleep(0.005)

    def open(self) -> None:
        self.path.touch()


MODELS = {
    "deadline": "",
    "bounded": "dynamic_batching: {default_queue_policy: {max_queue_size: 2}}\n",
    "cancel": "",
    "prio": "dynamic_batching: {priority_levels: 2, default_priority_level: 2}\n",
    "ordered": "instance_group: [{count: 2, kind: KIND_CPU}]\ndynamic_batching: {preserve_ordering: true}\n",
    "unordered": "instance_group: [{count: 2, kind: KIND_CPU}]\ndynamic_batching: {}\n",
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    gates = {}
    for name, extra in MODELS.items():
        gates[name] = Gate(repo / f"{name}.gate")
        builders.gated_model(repo, name, extra, gate=gates[name].path, max_batch_size=1)
    builders.gated_model(repo, "pair", "instance_group: [{count: 2, kind: KIND_CPU}]\n", barrier=True)
    gates["late"] = Gate(repo / "late.gate")  # batches of up to 4; a request past its deadline still runs
    builders.gated_model(repo, "late", "dynamic_batching: {default_queue_policy: {timeout_action: DELAY, "
                         "default_timeout_microseconds: 20000}}\n", gate=gates["late"].path, max_batch_size=4)
    server = RunningServer(repo)
    yield server, gates
    server.stop()


def send(server, model, x, timeout_s=30, **params):
    return kserve.stub(server.channel).ModelInfer.future(kserve.request(model, {"X": x}, **params), timeout=timeout_s)


def stats(server, model) -> pb.ModelStatistics:
    return kserve.stub(server.channel).ModelStatistics(pb.ModelStatisticsRequest(name=model)).model_stats[0]


def test_expired_requests_are_answered_while_the_instance_is_busy_and_never_run(env):
    server, gates = env
    held = send(server, "deadline", HOLD)
    gates["deadline"].wait_running()
    by_parameter = send(server, "deadline", GO, timeout=50_000)  # 50 ms, the Triton `timeout` parameter
    by_grpc_deadline = send(server, "deadline", GO, timeout_s=1.0)  # reaches the queue well before it passes
    with pytest.raises(grpc.RpcError) as info:
        by_parameter.result()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline" in info.value.details()
    with pytest.raises(grpc.RpcError):
        by_grpc_deadline.result()
    server.wait_for_metric("ferry_deadline_misses", 2, model="deadline")
    assert not held.done()  # both answered while the first request was still executing
    gates["deadline"].open()
    assert kserve.outputs(held.result())["Y"].tolist() == HOLD.tolist()
    s = stats(server, "deadline")
    assert s.execution_count == 1 and s.inference_count == 1  # the expired ones never executed


def test_full_queue_refuses_at_once_and_admitted_requests_complete(env):
    server, gates = env
    held = send(server, "bounded", HOLD)
    gates["bounded"].wait_running()
    queued = [send(server, "bounded", GO) for _ in range(2)]
    server.wait_for_metric("nv_inference_pending_request_count", 2, model="bounded")
    with pytest.raises(grpc.RpcError) as info:
        kserve.infer(server.channel, "bounded", {"X": GO})
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "queue" in info.value.details() and "full" in info.value.details()
    gates["bounded"].open()
    for future in [held, *queued]:
        assert kserve.outputs(future.result())["Y"].shape == (1, 2)
    assert server.metric("nv_inference_request_failure", model="bounded", reason="REJECTED") == 1
    assert stats(server, "bounded").execution_count == 3


def test_cancelled_call_leaves_the_queue_and_never_runs(env):
    server, gates = env
    held = send(server, "cancel", HOLD)
    gates["cancel"].wait_running()
    doomed = send(server, "cancel", GO)
    server.wait_for_metric("nv_inference_pending_request_count", 1, model="cancel")
    doomed.cancel()
    server.wait_for_metric("nv_inference_request_failure", 1, model="cancel", reason="CANCELED")
    assert server.metric("nv_inference_pending_request_count", model="cancel") == 0
    gates["cancel"].open()
    held.result()
    s = stats(server, "cancel")
    assert s.execution_count == 1 and s.inference_count == 1


def test_higher_priority_runs_first(env):
    server, gates = env
    held = send(server, "prio", HOLD)
    gates["prio"].wait_running()
    low = [send(server, "prio", GO) for _ in range(2)]
    server.wait_for_metric("nv_inference_pending_request_count", 2, model="prio")
    high = send(server, "prio", GO, priority=1)
    server.wait_for_metric("nv_inference_pending_request_count", 3, model="prio")
    gates["prio"].open()
    turn = lambda f: int(kserve.outputs(f.result())["TURN"][0, 0])  # noqa: E731
    assert turn(held) == 0 and turn(high) == 1 and sorted(turn(f) for f in low) == [2, 3]


@pytest.mark.parametrize("model, ordered", [("ordered", True), ("unordered", False)])
def test_preserve_ordering_holds_later_answers(env, model, ordered):
    server, gates = env
    first = send(server, model, HOLD)
    gates[model].wait_running()
    second = send(server, model, GO)  # runs at once on the second instance
    deadline = time.monotonic() + 20
    while stats(server, model).execution_count < 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    if ordered:
        with pytest.raises(grpc.FutureTimeoutError):
            second.result(timeout=0.5)  # executed, but its answer waits for the first request's
    else:
        second.result(timeout=20)
    assert not first.done()
    gates[model].open()
    first.result()
    second.result()


def test_two_instances_run_two_batches_at_the_same_time(env):
    server, _ = env
    # Each execution waits at a two-party barrier: it only passes if both instances run at once.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda i: kserve.infer(server.channel, "pair", {"X": GO * i}), (1, 2)))
    assert [r["Y"].tolist() for r in results] == [[[1, 2]], [[2, 4]]]
    assert stats(server, "pair").execution_count == 2


def test_prometheus_counters_equal_model_statistics(env):
    server, _ = env
    for s in kserve.stub(server.channel).ModelStatistics(pb.ModelStatisticsRequest()).model_stats:
        labels = {"model": s.name, "version": s.version}
        assert server.metric("nv_inference_count", **labels) == s.inference_count
        assert server.metric("nv_inference_exec_count", **labels) == s.execution_count
        assert server.metric("nv_inference_request_success", **labels) == s.inference_stats.success.count
        failures = sum(server.metric("nv_inference_request_failure", reason=r, **labels)
                       for r in ("REJECTED", "BACKEND", "CANCELED", "OTHER"))
        assert failures == s.inference_stats.fail.count
        assert server.metric("nv_inference_queue_duration_us", **labels) == pytest.approx(s.inference_stats.queue.ns / 1000)
        assert server.metric("ferry_batch_size_count", **labels) == s.execution_count


def test_a_batch_counts_each_request_once_in_queue_times_and_deadline_misses(env):
    """Queue times and late runs are recorded once per dispatched batch: still one count per request."""
    server, gates = env
    held = send(server, "late", HOLD)
    gates["late"].wait_running()
    late = [send(server, "late", GO) for _ in range(3)]
    server.wait_for_metric("nv_inference_pending_request_count", 3, model="late")
    queued = time.monotonic()  # all three arrived before this: their 20 ms deadlines end before queued + 0.02
    wait_for(lambda: time.monotonic() - queued > 0.2, what="the queued requests' 20 ms deadlines to be well past")
    gates["late"].open()
    for future in [held, *late]:
        assert kserve.outputs(future.result())["Y"].shape == (1, 2)  # DELAY: run, late
    s = stats(server, "late")
    assert s.execution_count == 2 and [(b.batch_size, b.compute_infer.count) for b in s.batch_stats] == [(1, 1), (3, 1)]
    assert s.inference_stats.queue.count == 4 and s.inference_stats.success.count == 4
    assert server.metric("ferry_deadline_misses", model="late") == 3
    assert server.metric("ferry_queue_duration_us_count", model="late") == 4
    assert server.metric("ferry_request_duration_us_count", model="late") == 4
    assert server.metric("ferry_batch_size_count", model="late") == 2

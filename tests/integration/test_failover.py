"""Replicas fail over through client-side balancing (clients/balancing.py): Ferry's own clients, given
several addresses, spread calls over every ready replica, lose none when one drains (SIGTERM), and lose
at most the calls in flight on one that dies (SIGKILL). Who served what is read from each replica's own
ModelStatistics, and every trigger is a count (requests served), never a sleep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from clients import FerryClientError, InferenceClient
from tests.conftest import ROOT, RunningServer, link_shipped_models

A = np.arange(16, dtype=np.float32).reshape(1, 16)
INPUTS = {"INPUT0": A, "INPUT1": np.ones_like(A)}


def served(replica: RunningServer) -> int:
    with InferenceClient(replica.address, timeout_s=30) as client:
        return sum(s.inference_stats.success.count for s in client.model_statistics("simple"))


def wait_for(predicate, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def replicas(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    link_shipped_models(repo, "simple")
    started = [RunningServer(repo, "--drain-grace-seconds", "30") for _ in range(3)]
    yield started
    for replica in started:
        replica.stop(signal.SIGKILL)


CLIENTS, PER_CLIENT = 16, 100


def test_sigterm_of_one_replica_under_load_fails_no_request(replicas):
    client = InferenceClient(",".join(r.address for r in replicas), timeout_s=60)
    outcomes = {"ok": 0, "failed": []}
    lock = threading.Lock()

    def caller() -> None:
        for _ in range(PER_CLIENT):
            try:
                out = client.infer("simple", INPUTS)
                assert np.array_equal(out["OUTPUT0"], A + 1)
                with lock:
                    outcomes["ok"] += 1
            except FerryClientError as exc:
                with lock:
                    outcomes["failed"].append(exc)

    threads = [threading.Thread(target=caller) for _ in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        # Spread: every replica takes a share before one leaves (round_robin, not pick_first).
        wait_for(lambda: min(served(r) for r in replicas) >= 50, "every replica to serve 50 requests")
        at_sigterm = [served(r) for r in replicas]
        assert min(at_sigterm) >= 0.2 * sum(at_sigterm), at_sigterm
        replicas[0].proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a caller was left hanging"
        assert outcomes["failed"] == []
        assert outcomes["ok"] == CLIENTS * PER_CLIENT
        survivors = [served(r) for r in replicas[1:]]
        assert all(after > before for after, before in zip(survivors, at_sigterm[1:]))  # the load moved on
        assert sum(survivors) + at_sigterm[0] <= CLIENTS * PER_CLIENT
        assert replicas[0].proc.wait(60) == 0 and "ferry: stopped" in replicas[0].output
    finally:
        client.close()


CONCURRENCY, WARMUP = 8, 4


def perf(url: str, requests: int, json_path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "server", "perf", "simple", "--url", url, "--concurrency",
                             str(CONCURRENCY), "--requests", str(requests), "--warmup", str(WARMUP), "--timeout", "60",
                             "--json", str(json_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONIOENCODING": "utf-8"})


def test_perf_spreads_over_replicas_and_loses_only_in_flight_calls_to_sigkill(replicas, tmp_path):
    url = ",".join(r.address for r in replicas)
    run = perf(url, 600, tmp_path / "even.json")
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    (point,) = json.loads((tmp_path / "even.json").read_text())["points"]
    assert point["completed"] == 600 and point["errors"] == 0
    shares = point["replicas"]
    assert set(shares) == {r.address for r in replicas}
    assert sum(shares.values()) == 600 + WARMUP  # every request counted once, by the replica that served it
    assert min(shares.values()) >= 0.2 * 600, shares
    assert "replica " + replicas[0].address in out  # the table names each replica's share

    total = 4000
    base = [served(r) for r in replicas]
    run = perf(url, total, tmp_path / "kill.json")
    try:
        wait_for(lambda: sum(served(r) for r in replicas) - sum(base) >= 600, "600 requests into the run")
        assert run.poll() is None, "the run ended before the replica could be killed"
        replicas[2].proc.kill()
        replicas[2].proc.wait(60)
        at_kill = [served(r) for r in replicas[:2]]
        out, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, err
    (point,) = json.loads((tmp_path / "kill.json").read_text())["points"]
    # At most the calls in flight on the killed replica fail (never more than the callers), each as
    # UNAVAILABLE; gRPC retried the others on the survivors. Everything else succeeded.
    assert point["requests"] == total and point["completed"] + point["errors"] == total
    assert point["errors"] <= CONCURRENCY, point["error_messages"]
    assert all(message.startswith("UNAVAILABLE") for message in point["error_messages"]), point["error_messages"]
    shares = point["replicas"]
    assert shares[replicas[2].address] is None  # gone: no figure rather than a wrong one
    survivors = [served(r) for r in replicas[:2]]
    assert all(after > then for after, then in zip(survivors, at_kill))  # both survivors kept serving
    assert all(shares[r.address] > 0 for r in replicas[:2])

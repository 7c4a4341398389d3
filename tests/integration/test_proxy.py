"""Three replicas behind a real L7 gRPC proxy (HAProxy, deploy/haproxy/haproxy.cfg as shipped): calls
on one client connection are spread over every replica, and when one replica drains (SIGTERM) and
another dies (SIGKILL) under load, no caller hangs, the only failures are UNAVAILABLE and few (the
proxy keeps sending to a draining replica; see below), and the last replica takes the rest. The client
retries UNAVAILABLE (a drain's answer, which the proxy cannot retry itself); per-replica counts come
from each replica's ModelStatistics."""

from __future__ import annotations

import os
import shutil
import signal
import threading

import grpc
import numpy as np
import pytest

from bench.proxy import Proxy
from clients import balancing
from tests import kserve
from tests.conftest import RunningServer, link_shipped_models
from tests.integration.test_failover import served, wait_for

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None and not os.path.exists("/usr/sbin/haproxy"),
                                reason="haproxy not installed (.ci/run installs Debian's package)")
CLIENTS, PER_CLIENT = 8, 300


def test_the_proxy_spreads_one_connection_and_survives_a_drain_and_a_kill(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    link_shipped_models(repo, "simple")
    replicas = [RunningServer(repo, "--drain-grace-seconds", "30") for _ in range(3)]
    proxy = Proxy([r.address for r in replicas], tmp_path)
    channel = grpc.insecure_channel(proxy.target, options=[
        ("grpc.service_config", balancing.service_config(balanced=False)), ("grpc.enable_retries", 1)])
    stub = kserve.stub(channel)
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    request = kserve.request("simple", {"INPUT0": a, "INPUT1": np.ones_like(a)})
    ok, failed, lock = [0], [], threading.Lock()

    def caller() -> None:
        for _ in range(PER_CLIENT):
            try:
                stub.ModelInfer(request, timeout=60)
                with lock:
                    ok[0] += 1
            except grpc.RpcError as err:
                with lock:
                    failed.append((err.code(), err.details()))

    threads = [threading.Thread(target=caller) for _ in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: min(served(r) for r in replicas) >= 40, "every replica to serve 40 requests")
        shares = [served(r) for r in replicas]
        assert min(shares) >= 0.2 * sum(shares), shares  # one connection, three replicas: L7, per call
        replicas[0].proc.send_signal(signal.SIGTERM)
        before = [served(r) for r in replicas[1:]]
        wait_for(lambda: sum(served(r) for r in replicas[1:]) >= sum(before) + 200, "200 more after the drain")
        assert any(t.is_alive() for t in threads), "the load ended before the kill"
        replicas[1].proc.kill()
        replicas[1].proc.wait(60)
        at_kill = served(replicas[2])
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a caller was left hanging"
        assert ok[0] + len(failed) == CLIENTS * PER_CLIENT
        assert {code for code, _ in failed} <= {grpc.StatusCode.UNAVAILABLE}, failed
        # HAProxy checks TCP, not grpc.health.v1: it keeps sending calls to the draining replica, which
        # answers each UNAVAILABLE until its callers go quiet. The client's retries land on another
        # replica most of the time, not always (five attempts, round robin over two), so a few calls fail;
        # client-side balancing (test_failover.py) watches health and loses none. Bound: 5% of the calls.
        assert len(failed) <= 0.05 * CLIENTS * PER_CLIENT, failed
        assert served(replicas[2]) > at_kill  # the survivor took the rest
        assert replicas[0].proc.wait(60) == 0
    finally:
        channel.close()
        proxy.stop()
        for r in replicas:
            r.stop(signal.SIGKILL)

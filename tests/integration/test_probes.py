"""What Kubernetes' native gRPC probes see (deploy/kubernetes): readiness asks grpc.health.v1 for "",
liveness for "liveness". A replica still loading or draining must be out of rotation (not ready) but
never restarted (live), so the two names answer differently in exactly those two phases."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests import builders, kserve
from tests.conftest import ROOT
from tests.integration.test_startup_loading import SLOW_MODEL

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def status(channel, service: str) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status


def test_readiness_follows_loading_and_draining_while_liveness_stays_serving(tmp_path):
    release = tmp_path / "release"
    folder = tmp_path / "repo" / "slow"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(SLOW_MODEL)
    (folder / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 4\ninput: [{name: X, data_type: TYPE_FP32, dims: [2]}]\n"
        "output: [{name: Y, data_type: TYPE_FP32, dims: [2]}]\n"
        f"parameters: {{release: {{string_value: '{release}'}}}}\n")
    gate = tmp_path / "gate"  # a request held here keeps the drain (and so the server) going while we look
    builders.gated_model(tmp_path / "repo", "held", gate=gate, max_batch_size=1)
    proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--model-repository", str(tmp_path / "repo"),
                             "--grpc-port", "0", "--http-port", "-1", "--metrics-port", "-1",
                             "--drain-grace-seconds", "120"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        address = next(m.group(1) for line in proc.stdout if (m := re.search(r"ferry: serving gRPC on (\S+)", line)))
        with grpc.insecure_channel(address) as channel:
            assert status(channel, "") == NOT_SERVING  # loading: the model's initialize waits for `release`
            assert status(channel, "inference.GRPCInferenceService") == NOT_SERVING
            assert status(channel, "liveness") == SERVING

            release.touch()
            assert any(line.startswith("ferry: ready") for line in proc.stdout)
            assert status(channel, "") == SERVING
            assert status(channel, "liveness") == SERVING

            held = kserve.stub(channel).ModelInfer.future(
                kserve.request("held", {"X": np.full((1, 2), -1, np.float32)}), timeout=120)
            deadline = time.monotonic() + 60
            while not (tmp_path / "gate.running").exists():
                assert time.monotonic() < deadline, "the held request never started"
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            while status(channel, "") != NOT_SERVING:
                assert time.monotonic() < deadline, "readiness never dropped after SIGTERM"
                time.sleep(0.02)
            assert status(channel, "liveness") == SERVING  # draining: out of rotation, not dead
            gate.touch()  # the admitted request finishes, then the drain ends
            assert kserve.outputs(held.result())["Y"].tolist() == [[-1, -1]]
        assert proc.wait(60) == 0
    finally:
        release.touch()
        gate.touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)

"""A model still loading at start-up is UNAVAILABLE ("loading"), not NOT_FOUND, and ModelReady says
`ready: false` (issue 18, row 12). The model's `initialize` waits for a file the test creates, so the
server is certainly still loading while the test asks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import grpc
import numpy as np

from protos import grpc_service_pb2 as pb
from tests import kserve
from tests.conftest import ROOT

SLOW_MODEL = '''
import os, time
import numpy as np


class Model:
    def initialize(self, args):
        release = args["config"]["parameters"]["release"]["string_value"]
        deadline = time.monotonic() + 120
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.01)

    def execute(self, inputs):
        return {"Y": inputs["X"]}
'''


def test_models_loading_at_start_up_are_unavailable_then_ready(tmp_path):
    release = tmp_path / "release"
    folder = tmp_path / "repo" / "slow"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(SLOW_MODEL)
    (folder / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 4\ninput: [{name: X, data_type: TYPE_FP32, dims: [2]}]\n"
        "output: [{name: Y, data_type: TYPE_FP32, dims: [2]}]\n"
        f"parameters: {{release: {{string_value: '{release}'}}}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--model-repository", str(tmp_path / "repo"),
                             "--grpc-port", "0", "--http-port", "-1", "--metrics-port", "-1"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        address = None
        for line in proc.stdout:
            if m := re.search(r"ferry: serving gRPC on (\S+)", line):
                address = m.group(1)
                break
        assert address, "the server never started serving gRPC"
        with grpc.insecure_channel(address) as channel:
            stub = kserve.stub(channel)
            assert not stub.ServerReady(pb.ServerReadyRequest(), timeout=30).ready
            assert not stub.ModelReady(pb.ModelReadyRequest(name="slow"), timeout=30).ready
            try:
                stub.ModelInfer(kserve.request("slow", {"X": np.ones((1, 2), np.float32)}), timeout=30)
                raise AssertionError("a model still loading answered")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                assert "model 'slow' is loading" in err.details()
            index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30).models
            assert [(m.name, m.state) for m in index] == [("slow", "LOADING")]
            try:  # a name the repository does not have is still NOT_FOUND
                stub.ModelReady(pb.ModelReadyRequest(name="absent"), timeout=30)
                raise AssertionError("an unknown model was answered")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.NOT_FOUND

            release.touch()
            deadline = time.monotonic() + 120
            while not stub.ModelReady(pb.ModelReadyRequest(name="slow"), timeout=30).ready:
                assert time.monotonic() < deadline, "the model never became ready"
                time.sleep(0.05)
            out = stub.ModelInfer(kserve.request("slow", {"X": np.ones((1, 2), np.float32)}), timeout=30)
            assert kserve.outputs(out)["Y"].tolist() == [[1.0, 1.0]]
    finally:
        release.touch()
        proc.terminate()
        proc.wait(60)

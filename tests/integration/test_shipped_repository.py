"""The README's serve command: `ferry serve --model-repository model_repository` serves every example."""

from __future__ import annotations

import numpy as np

from protos import grpc_service_pb2 as pb
from tests import kserve
from tests.conftest import ROOT, RunningServer


def test_every_shipped_model_is_ready_and_answers():
    server = RunningServer(ROOT / "model_repository")
    try:
        models = kserve.stub(server.channel).RepositoryIndex(pb.RepositoryIndexRequest()).models
        assert {(m.name, m.state) for m in models} == {
            ("simple", "READY"), ("classifier", "READY"), ("scaler_torchscript", "READY")}
        a = np.arange(32, dtype=np.float32).reshape(2, 16)
        out = kserve.infer(server.channel, "simple", {"INPUT0": a, "INPUT1": a})
        np.testing.assert_array_equal(out["OUTPUT0"], 2 * a)
        probs = kserve.infer(server.channel, "classifier", {"features": np.ones((3, 32), np.float32)})["probabilities"]
        assert probs.shape == (3, 4)
        np.testing.assert_allclose(probs.sum(axis=1), 1, rtol=1e-5)
        scaled = kserve.infer(server.channel, "scaler_torchscript", {"x": np.zeros((1, 8), np.float32)})["scaled"]
        assert scaled.shape == (1, 8) and np.isfinite(scaled).all() and np.abs(scaled).sum() > 0
        config = kserve.stub(server.channel).ModelConfig(pb.ModelConfigRequest(name="classifier")).config
        assert config.instance_group[0].count == 2  # the pbtxt arrived as written
    finally:
        assert server.stop() == 0

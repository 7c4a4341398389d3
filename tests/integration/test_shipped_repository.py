"""The README's serve command: `ferry serve --model-repository model_repository` serves every example."""

from __future__ import annotations

import numpy as np

from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from protos import grpc_service_pb2 as pb
from tests import kserve
from tests.conftest import ROOT, RunningServer


def test_every_shipped_model_is_ready_and_answers():
    server = RunningServer(ROOT / "model_repository")
    try:
        models = kserve.stub(server.channel).RepositoryIndex(pb.RepositoryIndexRequest()).models
        assert {(m.name, m.state) for m in models} == {
            ("simple", "READY"), ("classifier", "READY"), ("scaler_torchscript", "READY"), ("tiny_llama", "READY"),
            ("preprocess", "READY"), ("postprocess", "READY"), ("pipeline", "READY"), ("repeat_int32", "READY"),
            ("simple_sequence", "READY")}
        a = np.arange(32, dtype=np.float32).reshape(2, 16)
        out = kserve.infer(server.channel, "simple", {"INPUT0": a, "INPUT1": a})
        np.testing.assert_array_equal(out["OUTPUT0"], 2 * a)
        raw = np.arange(32, dtype=np.float32).reshape(2, 16)
        result = kserve.infer(server.channel, "pipeline", {"RAW": raw})["RESULT"]
        np.testing.assert_array_equal(result, (3 * raw + 1) * (raw - 1))  # (2r + (r+1)) * (2r - (r+1))
        sums = []
        for i, value in enumerate([3, 4, 5]):
            request = kserve.request("simple_sequence", {"INPUT": np.array([[value]], np.int32)})
            request.parameters["sequence_id"].int64_param = 42
            request.parameters["sequence_start"].bool_param = i == 0
            request.parameters["sequence_end"].bool_param = i == 2
            sums.append(int(kserve.outputs(kserve.stub(server.channel).ModelInfer(request, timeout=30))["OUTPUT"][0, 0]))
        assert sums == [3, 7, 12]
        probs = kserve.infer(server.channel, "classifier", {"features": np.ones((3, 32), np.float32)})["probabilities"]
        assert probs.shape == (3, 4)
        np.testing.assert_allclose(probs.sum(axis=1), 1, rtol=1e-5)
        scaled = kserve.infer(server.channel, "scaler_torchscript", {"x": np.zeros((1, 8), np.float32)})["scaled"]
        assert scaled.shape == (1, 8) and np.isfinite(scaled).all() and np.abs(scaled).sum() > 0
        config = kserve.stub(server.channel).ModelConfig(pb.ModelConfigRequest(name="classifier")).config
        assert config.instance_group[0].count == 2  # the pbtxt arrived as written
        request = gen.GenerateRequest(model_name="tiny_llama", text="A ferry leaves",
                                      sampling=gen.SamplingParams(max_tokens=8, ignore_eos=True))
        streamed = list(gen_grpc.GenerationStub(server.channel).Generate(request, timeout=60))
        assert sum(len(r.token_ids) for r in streamed) == 8 and streamed[-1].finish_reason == "length"
    finally:
        assert server.stop() == 0

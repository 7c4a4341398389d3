"""bench/floor_server.py --model: the smallest batching server must answer what the model computes, row by
row, or bench.hotpath's reference beside Ferry measures a server that does less work than Ferry does."""

from __future__ import annotations

import sys

import grpc
import numpy as np
import onnxruntime as ort

from bench import common, models
from bench.floor_server import split_rows
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc


def test_the_model_hop_answers_each_request_its_own_rows(tmp_path):
    model = models.light_mlp(tmp_path / "light" / "1" / "model.onnx")
    proc, address = common.start_server([sys.executable, "-m", "bench.floor_server", "0", "--model", str(model)])
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            rng = np.random.default_rng(3)
            sent = [rng.standard_normal((rows, 256)).astype(np.float32) for rows in (1, 3, 2)]
            calls = [stub.ModelInfer.future(pb.ModelInferRequest.FromString(common.infer_payload("light", {"x": x})))
                     for x in sent]
            answers = [call.result(timeout=60) for call in calls]
            stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name="light")).model_stats[0]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    for x, answer in zip(sent, answers):
        assert list(answer.outputs[0].shape) == [len(x), 16]
        y = np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(len(x), 16)
        np.testing.assert_allclose(y, session.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert stats.inference_count == 6 and 1 <= stats.execution_count <= 3


def test_a_batch_output_is_split_back_into_each_requests_rows():
    parts = [np.zeros((1, 4)), np.zeros((3, 4)), np.zeros((2, 4))]
    y = np.arange(6 * 2, dtype=np.float32).reshape(6, 2)
    assert split_rows(y, parts) == [y[0:1].tobytes(), y[1:4].tobytes(), y[4:6].tobytes()]

"""Requests joined into batches by the server, checked through ModelStatistics counts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer, approx_fp32

WIDTH = 16


def reference_mlp(x: np.ndarray) -> np.ndarray:
    """The same seeded weights the builder used, computed with numpy."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((WIDTH, WIDTH)).astype(np.float32)
    b = rng.standard_normal(WIDTH).astype(np.float32)
    return np.maximum(x @ w + b, 0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    builders.mlp(repo / "mlp" / "1" / "model.onnx", WIDTH)
    # A window far longer than any test waits: the batch leaves when it is full (32 rows), so how
    # many batches 32 concurrent requests make never depends on how fast the clients start.
    (repo / "mlp" / "config.yaml").write_text(
        "max_batch_size: 32\ndynamic_batching: {max_queue_delay_microseconds: 60000000}\n")
    builders.fragile(repo / "ragged" / "1" / "model.onnx")
    (repo / "ragged" / "config.yaml").write_text(
        "max_batch_size: 16\ndynamic_batching: {max_queue_delay_microseconds: 50000}\n")
    builders.mlp(repo / "unbatched" / "1" / "model.onnx", WIDTH)
    (repo / "unbatched" / "config.pbtxt").write_text(
        'max_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, 16 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1, 16 ] } ]\n')
    server = RunningServer(repo)
    yield server
    server.stop()


def stats(server, model: str) -> pb.ModelStatistics:
    return kserve.stub(server.channel).ModelStatistics(pb.ModelStatisticsRequest(name=model)).model_stats[0]


def concurrently(fn, args, workers: int = 32):
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, args))


def test_concurrent_single_rows_are_batched(server):
    rows = np.random.default_rng(1).standard_normal((32, WIDTH)).astype(np.float32)
    results = concurrently(lambda i: kserve.infer(server.channel, "mlp", {"X": rows[i:i + 1]})["Y"], range(32))
    expected = reference_mlp(rows)
    for i, got in enumerate(results):  # ONNX Runtime in a batch of 32 against numpy, row by row
        assert got == approx_fp32(expected[i:i + 1])
    s = stats(server, "mlp")
    assert s.inference_count == 32
    assert s.execution_count == 1  # one full ferry
    assert [(b.batch_size, b.compute_infer.count) for b in s.batch_stats] == [(32, 1)]


def test_unjoinable_shapes_run_in_separate_batches(server):
    # widths 3 and 6 cannot share a batch; each answer must still be exactly its own input
    inputs = [np.full((1, 3 if i % 2 else 6), i, np.float32) for i in range(16)]
    results = concurrently(lambda x: kserve.infer(server.channel, "ragged", {"X": x})["Y"], inputs, workers=16)
    for x, y in zip(inputs, results):
        np.testing.assert_array_equal(y, x)
    s = stats(server, "ragged")
    assert s.inference_count == 16 and s.execution_count >= 2


def test_model_without_batching_runs_requests_one_by_one(server):
    rows = np.random.default_rng(2).standard_normal((8, 2, WIDTH)).astype(np.float32)
    results = concurrently(lambda i: kserve.infer(server.channel, "unbatched", {"X": rows[i]})["Y"], range(8), workers=8)
    for x, y in zip(rows, results):  # ONNX Runtime against numpy
        assert y == approx_fp32(reference_mlp(x))
    s = stats(server, "unbatched")
    assert s.execution_count == 8 and s.inference_count == 8
    config = kserve.stub(server.channel).ModelConfig(pb.ModelConfigRequest(name="unbatched")).config
    assert config.max_batch_size == 0 and not config.HasField("dynamic_batching")

"""Variable-length requests padded into shared batches, and cost buckets, through a real server.

Batches are made deterministic by a long window (2 s) and rounds that fill a batch exactly: a full
batch leaves at once, so every round below is one backend call whose members the test knows.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer

# Far longer than any test waits: every round fills its batch (or its cost budget) and leaves at
# once, so no batch boundary depends on how fast the client threads start.
WINDOW = "dynamic_batching: {max_queue_delay_microseconds: 60000000}\n"
MODELS = {
    "solo": "",  # no dynamic_batching: every request runs alone, the reference
    "padded": WINDOW,
    "zero": WINDOW,  # as "padded", kept apart so its batch counts are its own
    "binpacked": WINDOW + "binpack_batching: {bucket_boundaries: [8], max_batch_cost: 64}\n",
}
# rounds of (rows, length) requests, 4 rows each (max_batch_size), lengths deliberately mixed
ROUNDS = [[(1, 3), (1, 17), (1, 1), (1, 9)], [(2, 5), (1, 12), (1, 2)], [(1, 30), (3, 4)]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for name, extra in MODELS.items():
        builders.padded_sum(repo / name / "1" / "model.onnx")
        (repo / name / "config.yaml").write_text(builders.PADDED_SUM_CONFIG + extra)
    server = RunningServer(repo)
    yield server
    server.stop()


def tokens(rows: int, length: int, seed: int) -> np.ndarray:
    # small integers: every sum is exact in float32, whatever order a padded batch reduces in, so
    # answers must match bit for bit; leaked padding (1000) could not hide in rounding
    return np.random.default_rng(seed).integers(-8, 9, (rows, length, 2)).astype(np.float32)


def run_round(server, model: str, xs: list[np.ndarray], **params) -> list[dict[str, np.ndarray]]:
    with ThreadPoolExecutor(len(xs)) as pool:
        return list(pool.map(lambda x: kserve.infer(server.channel, model, {"X": x}, **params), xs))


def stats(server, model: str) -> pb.ModelStatistics:
    return kserve.stub(server.channel).ModelStatistics(pb.ModelStatisticsRequest(name=model)).model_stats[0]


@pytest.fixture(scope="module")
def padded_rounds(server) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """ROUNDS sent to "padded", each round concurrently: (input, answer) per request."""
    sent = []
    for r, shapes in enumerate(ROUNDS):
        xs = [tokens(rows, length, seed=10 * r + i) for i, (rows, length) in enumerate(shapes)]
        sent += zip(xs, run_round(server, "padded", xs))
    return sent


def test_padded_batches_answer_exactly_as_each_request_alone(server, padded_rounds):
    for x, got in padded_rounds:
        alone = kserve.infer(server.channel, "solo", {"X": x})
        assert got.keys() == alone.keys()
        for name in alone:
            np.testing.assert_array_equal(got[name], alone[name], err_msg=name)
        rows, length = x.shape[:2]
        np.testing.assert_array_equal(got["SUM"], x.sum(axis=1))  # lengths input masks the padding
        # so does the mask input; exact integer sums and one division: equal to the last bit on any CPU
        np.testing.assert_allclose(got["MEAN"], x.mean(axis=1), rtol=1e-6)
        np.testing.assert_array_equal(got["Y"], 2 * x + 1)  # sliced back to its own length
        np.testing.assert_array_equal(got["LEN"], np.full((rows, 1), length))  # lengths input filled
    s = stats(server, "padded")
    assert s.inference_count == 4 * len(ROUNDS) and s.execution_count == len(ROUNDS)  # one mixed batch per round


def test_padding_waste_is_counted_exactly(server, padded_rounds):
    # each round was one batch, padded to its longest member
    computed = sum(4 * max(length for _, length in shapes) for shapes in ROUNDS)
    real = sum(rows * length for shapes in ROUNDS for rows, length in shapes)
    server.wait_for_metric("ferry_computed_elements", computed, model="padded")
    assert server.metric("ferry_padding_elements", model="padded") == computed - real
    assert server.metric("ferry_padding_waste_ratio", model="padded") == pytest.approx((computed - real) / computed)
    assert server.metric("ferry_padding_waste_ratio", model="solo") == 0  # alone, nothing is padded


def test_server_filled_inputs_are_hidden_and_refused(server):
    meta = kserve.stub(server.channel).ModelMetadata(pb.ModelMetadataRequest(name="padded"))
    assert [t.name for t in meta.inputs] == ["X"]
    with pytest.raises(grpc.RpcError) as err:
        kserve.infer(server.channel, "solo", {"X": tokens(1, 3, 0), "LENGTHS": np.array([[3]])})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "filled in by the server" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        kserve.infer(server.channel, "solo", {"X": tokens(1, 3, 0)}, cost="heavy")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'cost'" in err.value.details()


def test_binpack_batches_one_cost_bucket_within_the_budget(server):
    # bucket 0 holds lengths <= 8: four short requests fill max_batch_size. Bucket 1: one of length 31
    # and a short one whose `cost` parameter (30) sends it there; 2 rows x 31 = 62 fills the budget of 64.
    shorts = [tokens(1, length, seed=length) for length in (2, 5, 8, 3)]
    long, costly = tokens(1, 31, seed=31), tokens(1, 2, seed=99)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(kserve.infer, server.channel, "binpacked", {"X": x}) for x in shorts + [long]]
        futures.append(pool.submit(kserve.infer, server.channel, "binpacked", {"X": costly}, cost=30))
        answers = [f.result() for f in futures]
    for x, got in zip(shorts + [long, costly], answers):
        alone = kserve.infer(server.channel, "solo", {"X": x})
        for name in alone:
            np.testing.assert_array_equal(got[name], alone[name], err_msg=name)
    model = {"model": "binpacked"}
    server.wait_for_metric("ferry_bucket_batch_size_count", 1, bucket="1", **model)
    assert server.metric("ferry_bucket_batch_size_count", bucket="0", **model) == 1
    assert server.metric("ferry_bucket_batch_size_sum", bucket="0", **model) == 4
    assert server.metric("ferry_bucket_batch_size_sum", bucket="1", **model) == 2
    assert server.metric("ferry_bucket_upper_cost", bucket="0", **model) == 8
    assert server.metric("ferry_bucket_upper_cost", bucket="1", **model) == float("inf")
    assert server.metric("ferry_bucket_queue_depth", bucket="1", **model) == 0
    padded = (4 * 8 - (2 + 5 + 8 + 3)) + (2 * 31 - (31 + 2))
    assert server.metric("ferry_padding_elements", **model) == padded


def test_a_zero_length_request_batched_with_others_is_answered_and_so_are_they(server):
    """A [1, 0] part used to break the byte copy of the whole batch (INTERNAL for every member)."""
    xs = [tokens(1, 0, seed=1), tokens(1, 5, seed=2), tokens(1, 3, seed=3), tokens(1, 0, seed=4)]
    got = run_round(server, "zero", xs)  # 4 rows: one full batch
    for x, answer in zip(xs, got):
        alone = kserve.infer(server.channel, "solo", {"X": x})
        for name in alone:
            np.testing.assert_array_equal(answer[name], alone[name], err_msg=name)
        np.testing.assert_array_equal(answer["SUM"], x.sum(axis=1))
        assert answer["Y"].shape == x.shape
    s = stats(server, "zero")
    assert s.inference_count == 4 and s.execution_count == 1  # they really shared one batch

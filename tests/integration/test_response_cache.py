"""The response cache (`--cache-config local,size=BYTES` + `response_cache: {enable: true}`), over gRPC.

The cached model is the gated python model: its TURN output counts executions, so an answer that
comes back with an earlier execution's TURN was served from the cache, and "while the instance is
busy" is a state the test holds with the gate, not a timing guess.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve, model_kinds
from tests.conftest import RunningServer, wait_for

HOLD = np.array([[-1, -1]], np.float32)  # the gated model holds executions with a negative value
GO = np.array([[1, 2]], np.float32)
CACHED = "response_cache: {enable: true}\ndynamic_batching: {}\n"

STREAMER_MODEL = '''
class Model:
    def execute(self, inputs):
        yield {"Y": inputs["X"]}
'''
STREAMER_CONFIG = """
backend: python
max_batch_size: 0
input: [{name: X, data_type: TYPE_FP32, dims: [2]}]
output: [{name: Y, data_type: TYPE_FP32, dims: [2]}]
model_transaction_policy: {decoupled: true}
response_cache: {enable: true}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    builders.gated_model(repo, "cached", CACHED, gate=repo / "cached.gate")
    builders.gated_model(repo, "plain", "dynamic_batching: {}\n")
    model_kinds.python_model(repo, "streamer", STREAMER_MODEL, STREAMER_CONFIG)
    builders.gated_model(repo, "step", "dynamic_batching: {}\n")
    model_kinds.ensemble(repo, "pipeline", [("step", {"X": "X"}, "OUT")], "OUT", "response_cache {enable: true}\n")
    running = RunningServer(repo, "--cache-config", "local,size=1048576", "--model-control-mode", "explicit", "--load-model", "*")  # reloads: explicit control
    running.repo = repo
    yield running
    running.stop()


def infer(server, model: str, x: np.ndarray) -> dict[str, np.ndarray]:
    return kserve.outputs(kserve.stub(server.channel).ModelInfer(kserve.request(model, {"X": x}), timeout=60))


def stats(server, model: str) -> pb.ModelStatistics:
    return kserve.stub(server.channel).ModelStatistics(pb.ModelStatisticsRequest(name=model)).model_stats[0]


def test_a_repeated_request_is_answered_from_the_cache_while_the_instance_is_busy(server):
    first = infer(server, "cached", GO)
    held = kserve.stub(server.channel).ModelInfer.future(kserve.request("cached", {"X": HOLD}), timeout=120)
    wait_for((server.repo / "cached.gate.running").exists, what="the held execution to start")
    again = infer(server, "cached", GO)
    assert not held.done()  # answered while the only instance was held: it never queued
    assert again["Y"].tolist() == GO.tolist() and again["TURN"].tolist() == first["TURN"].tolist()
    (server.repo / "cached.gate").touch()
    assert kserve.outputs(held.result())["Y"].tolist() == HOLD.tolist()
    s = stats(server, "cached")
    assert (s.inference_stats.cache_hit.count, s.inference_stats.cache_miss.count) == (1, 2)
    assert s.inference_stats.success.count == 3  # hits are successes, as in Triton
    assert (s.execution_count, s.inference_count) == (2, 2)  # ... but neither executions nor inferences
    assert server.metric("nv_cache_num_hits_per_model", model="cached") == 1
    assert server.metric("nv_cache_num_misses_per_model", model="cached") == 2
    assert server.metric("nv_cache_num_entries") == 2
    assert server.metric("nv_cache_num_hits_per_model", model="plain") is None  # shown only where enabled


def test_only_an_identical_request_hits(server):
    before = stats(server, "cached")
    twice = np.concatenate([GO, GO])  # the same bytes twice: another shape, another request
    answers = [infer(server, "cached", x) for x in (GO * 2, twice, twice, GO.astype(np.float32) * 2)]
    after = stats(server, "cached")
    assert after.inference_stats.cache_miss.count - before.inference_stats.cache_miss.count == 2
    assert after.inference_stats.cache_hit.count - before.inference_stats.cache_hit.count == 2
    assert after.execution_count - before.execution_count == 2
    assert answers[1]["Y"].tolist() == twice.tolist() and answers[2]["TURN"].tolist() == answers[1]["TURN"].tolist()
    assert answers[3]["TURN"].tolist() == answers[0]["TURN"].tolist()


def test_an_ensemble_caches_at_the_top_and_a_hit_runs_no_step(server):
    answers = [infer(server, "pipeline", GO)["OUT"].tolist() for _ in range(3)]
    assert answers == [GO.tolist()] * 3
    assert stats(server, "step").execution_count == 1  # the step ran for the first call only
    s = stats(server, "pipeline")
    assert (s.inference_stats.cache_hit.count, s.inference_stats.cache_miss.count, s.inference_stats.success.count) == (2, 1, 3)


def test_reloading_a_step_model_retires_the_ensembles_entries(server):
    infer(server, "pipeline", GO)  # cached by the earlier test, or now
    before = stats(server, "pipeline").inference_stats
    kserve.stub(server.channel).RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="step"), timeout=60)
    assert infer(server, "pipeline", GO)["OUT"].tolist() == GO.tolist()
    after = stats(server, "pipeline").inference_stats
    assert (after.cache_miss.count - before.cache_miss.count, after.cache_hit.count - before.cache_hit.count) == (1, 0)
    assert stats(server, "step").execution_count == 1  # the reloaded step ran it


def test_a_model_without_the_cache_runs_every_request(server):
    runs = [infer(server, "plain", GO)["TURN"][0, 0] for _ in range(2)]
    assert runs[0] != runs[1] and stats(server, "plain").execution_count == 2
    assert stats(server, "plain").inference_stats.cache_hit.count == 0


def test_a_reloaded_model_never_answers_from_its_old_loads_entries(tmp_path):
    builders.gated_model(tmp_path, "cached", CACHED)
    server = RunningServer(tmp_path, "--cache-config", "local,size=1048576", "--model-control-mode", "explicit", "--load-model", "*")  # reloads: explicit control
    try:
        infer(server, "cached", GO)
        assert stats(server, "cached").inference_stats.cache_miss.count == 1
        kserve.stub(server.channel).RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="cached"), timeout=60)
        infer(server, "cached", GO)  # the same request: new weights could answer it differently
        s = stats(server, "cached")  # the new load's figures
        assert (s.inference_stats.cache_hit.count, s.inference_stats.cache_miss.count, s.execution_count) == (0, 1, 1)
        assert infer(server, "cached", GO)["Y"].tolist() == GO.tolist()
        assert stats(server, "cached").inference_stats.cache_hit.count == 1  # and its own answers are kept
    finally:
        server.stop()


def test_a_decoupled_model_cannot_enable_the_cache(server):
    index = {m.name: m for m in kserve.stub(server.channel).RepositoryIndex(pb.RepositoryIndexRequest()).models}
    assert index["streamer"].state == "UNAVAILABLE"
    assert "response_cache" in index["streamer"].reason and "decoupled" in index["streamer"].reason


def test_a_model_that_enables_the_cache_on_a_server_without_one_runs_every_request(tmp_path):
    builders.gated_model(tmp_path, "cached", CACHED)
    server = RunningServer(tmp_path)
    try:
        turns = [infer(server, "cached", GO)["TURN"][0, 0] for _ in range(2)]
        assert turns[0] != turns[1]
        assert "enables response_cache, but the server has no cache" in server.output
        assert server.metric("nv_cache_num_entries") is None
    finally:
        server.stop()


def test_http_and_front_end_processes_share_the_engines_cache(tmp_path):
    builders.gated_model(tmp_path, "cached", CACHED)
    server = RunningServer(tmp_path, "--cache-config", "local,size=1048576", "--frontend-processes", "2")
    try:
        turn = infer(server, "cached", GO)["TURN"].tolist()
        body = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}).encode()
        request = urllib.request.Request(f"{server.http_url}/v2/models/cached/infer", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            outputs = {o["name"]: o["data"] for o in json.loads(reply.read())["outputs"]}
        assert outputs["Y"] == [1, 2] and [outputs["TURN"]] == turn
        assert infer(server, "cached", GO)["TURN"].tolist() == turn  # through a front-end process again
        s = stats(server, "cached")
        assert (s.inference_stats.cache_hit.count, s.execution_count) == (2, 1)
    finally:
        server.stop()

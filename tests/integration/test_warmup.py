"""Triton's `model_warmup`: samples run through the model while it loads, before it is ready.

The models remember what they ran (a module-level count or the first batch they saw), so what the
first real request gets back shows what warmup did: no timing involved.
"""

from __future__ import annotations

import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve, model_kinds
from tests.conftest import RunningServer

FIRST_SEEN_MODEL = '''
import numpy as np

SEEN = []


class Model:
    """Y = the first row of the first batch this load ever ran, for every row."""

    def execute(self, inputs):
        SEEN.append(inputs["X"].copy())
        return {"Y": np.repeat(SEEN[0][:1], len(inputs["X"]), axis=0).astype(np.float32)}
'''
FAILING_MODEL = '''
class Model:
    def execute(self, inputs):
        raise RuntimeError("cannot warm up")
'''
CONFIG = """
backend: python
max_batch_size: 4
input: [{name: X, data_type: TYPE_FP32, dims: [2]}]
output: [{name: Y, data_type: TYPE_FP32, dims: [2]}]
"""


def sample(name: str, data: str, batch_size: int = 1, count: int = 1, input_name: str = "X") -> str:
    return (f"model_warmup: [{{name: {name}, batch_size: {batch_size}, count: {count}, inputs: {{{input_name}: "
            f"{{data_type: TYPE_FP32, dims: [2], {data}}}}}}}]\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    builders.gated_model(repo, "counted", "dynamic_batching: {}\n" + sample("zeros", "zero_data: true", 2, count=3))
    model_kinds.python_model(repo, "from_file", FIRST_SEEN_MODEL, CONFIG + sample("file", 'input_data_file: "x.bin"'))
    (repo / "from_file" / "warmup").mkdir()
    (repo / "from_file" / "warmup" / "x.bin").write_bytes(np.array([5, 7], np.float32).tobytes())
    model_kinds.python_model(repo, "no_file", FIRST_SEEN_MODEL, CONFIG + sample("lost", 'input_data_file: "gone.bin"'))
    model_kinds.python_model(repo, "wrong_input", FIRST_SEEN_MODEL, CONFIG + sample("typo", "zero_data: true",
                                                                                      input_name="Z"))
    model_kinds.python_model(repo, "failing", FAILING_MODEL, CONFIG + sample("boom", "random_data: true"))
    running = RunningServer(repo)
    yield running
    running.stop()


def index(server) -> dict:
    return {m.name: m for m in kserve.stub(server.channel).RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30).models}


def test_each_sample_runs_count_times_before_the_first_request_and_is_not_counted(server):
    out = kserve.infer(server.channel, "counted", {"X": np.ones((1, 2), np.float32)})
    assert out["TURN"].tolist() == [[3]]  # three warmup runs came first
    stats = kserve.stub(server.channel).ModelStatistics(pb.ModelStatisticsRequest(name="counted")).model_stats[0]
    assert (stats.execution_count, stats.inference_count) == (1, 1)
    assert "model 'counted': warmed up with sample 'zeros' (batch 2, 3 run(s) on 1 instance(s))" in server.output


def test_a_sample_from_a_file_reaches_the_model(server):
    out = kserve.infer(server.channel, "from_file", {"X": np.zeros((1, 2), np.float32)})
    assert out["Y"].tolist() == [[5, 7]]  # the first batch the model ran was the file's


@pytest.mark.parametrize("model, words", [
    ("no_file", ["model_warmup sample 'lost'", "no file no_file/warmup/gone.bin"]),
    ("wrong_input", ["model_warmup sample 'typo'", "'Z'"]),
    ("failing", ["model_warmup sample 'boom' failed", "cannot warm up"]),
])
def test_a_sample_that_cannot_run_fails_the_load_naming_it(server, model, words):
    entry = index(server)[model]
    assert entry.state == "UNAVAILABLE"
    assert all(w in entry.reason for w in words), entry.reason
    assert index(server)["counted"].state == "READY"  # the others serve

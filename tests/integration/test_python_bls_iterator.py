"""The iterator `exec(decoupled=True)` answers with, as Triton's bls tests read it:

- a model that is not decoupled sends its one response with the final flag: the iterator gives that
  response and then StopIteration (no empty last response), whether the call succeeded or failed, with
  exec and with async_exec;
- a decoupled model that sends the final flag alone ends with Triton's empty last response;
- once the last response has come, iterating again gives every response again from the first; an
  iteration left midway resumes where it stopped; next() after the end raises StopIteration.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import kserve
from tests.conftest import RunningServer

CALLER = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


def request(model, inputs):
    return pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=["OUT"])


def read(response):
    if response.has_error():
        return "error: " + response.error().message()
    out = pb_utils.get_output_tensor_by_name(response, "OUT")
    return None if out is None else out.as_numpy().tolist()


def drained(responses):
    seen = [read(r) for r in responses]
    if next(responses, None) is not None:  # a finished iterator must stay finished
        seen.append("next gave more")
    return seen


class TritonPythonModel:
    async def execute(self, requests):
        x = pb_utils.Tensor("IN", np.array([3], np.int32))
        seen = {
            "single": drained(request("tsingle", [x]).exec(decoupled=True)),
            "single_async": drained(await request("tsingle", [x]).async_exec(decoupled=True)),
            "single_error": drained(request("tsingle", []).exec(decoupled=True)),
        }
        stream = request("tcount", [x]).exec(decoupled=True)  # 3, 3, 3, then the final flag alone
        first = read(next(stream))
        seen["rest"] = drained(stream)
        seen["again"] = drained(stream)
        seen["once_more"] = [read(r) for r in stream]
        seen["first"] = first
        midway = []
        for response in stream:
            midway.append(read(response))
            if len(midway) == 2:
                break
        midway.append(read(next(stream)))
        seen["midway"] = midway
        seen["resumed"] = drained(stream)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([json.dumps(seen).encode()], np.object_))])
                for _ in requests]
'''
CALLER_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "X", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] }]
"""

SINGLE = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)])
                for r in requests]
'''
# As python_backend's examples/decoupled square model: IN responses of IN, then the final flag alone.
COUNT = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            sender = r.get_response_sender()
            for _ in range(int(x[0])):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
IO_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }]
"""


def write(repo, name: str, source: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write(repo, "tcaller", CALLER, CALLER_CONFIG)
    write(repo, "tsingle", SINGLE, IO_CONFIG)
    write(repo, "tcount", COUNT, IO_CONFIG + "model_transaction_policy { decoupled: true }\n")
    server = RunningServer(repo)
    try:
        return json.loads(kserve.infer(server.channel, "tcaller", {"X": np.array([0], np.int32)})["OUT"][0])
    finally:
        server.stop()


def test_a_model_that_is_not_decoupled_gives_one_response_then_stop_iteration(seen):
    assert seen["single"] == [[6]]
    assert seen["single_async"] == [[6]]
    assert len(seen["single_error"]) == 1 and seen["single_error"][0].startswith("error: ")
    assert "expected 1 inputs but got 0 inputs for model 'tsingle'" in seen["single_error"][0]


def test_the_final_flag_sent_alone_is_an_empty_last_response(seen):
    assert seen["first"] == [3]
    assert seen["rest"] == [[3], [3], None]


def test_a_finished_iterator_iterated_again_gives_every_response_from_the_first(seen):
    assert seen["again"] == [[3], [3], [3], None]
    assert seen["once_more"] == [[3], [3], [3], None]


def test_an_iteration_left_midway_resumes_where_it_stopped(seen):
    assert seen["midway"] == [[3], [3], [3]]
    assert seen["resumed"] == [None]

"""What a BLS call costs the server in memory, as Triton's bls_memory test (a 1 GiB tensor through BLS to
an identity model, then four of 200 MiB) leans on: once a call is answered, nothing in the server keeps
its request (and so its input and output tensors) alive. The server runs with the cycle collector off
(tests/uncollected.py), so a request that only a collection would free stays counted."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from tests import kserve
from tests.conftest import RunningServer, wait_for

# Sends a tensor too large for the arena (it travels in the frames) and a small one to tcallee, with
# exec(), exec(decoupled=True) and async_exec(), and to the decoupled tstream; answers whether every
# output equalled its input.
CALLER = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


def request(model, x):
    return pb_utils.InferenceRequest(model_name=model, inputs=[pb_utils.Tensor("INPUT0", x)],
                                     requested_output_names=["OUTPUT0"])


def same(response, x):
    return not response.has_error() and bool(np.array_equal(
        pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy(), x))


class TritonPythonModel:
    async def execute(self, requests):
        seen = []
        for x in (np.arange(5 << 20, dtype=np.float32).reshape(1, -1), np.ones((1, 4), np.float32)):
            seen.append(same(request("tcallee", x).exec(), x))
            seen.append(same(next(request("tcallee", x).exec(decoupled=True)), x))
            seen.append(same(await request("tcallee", x).async_exec(), x))
            seen.append(same(next(request("tstream", x).exec(decoupled=True)), x))
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([json.dumps(seen).encode()], np.object_))])
                for _ in requests]
'''
CALLER_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "X", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] }]
"""

IDENTITY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
'''
STREAM = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            r.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
                    r, "INPUT0").as_numpy())]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
IDENTITY_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [ -1, -1 ] }]
output [{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1, -1 ] }]
"""


def write(repo, name: str, source: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write(repo, "tmem", CALLER, CALLER_CONFIG)
    write(repo, "tcallee", IDENTITY, IDENTITY_CONFIG)
    write(repo, "tstream", STREAM, IDENTITY_CONFIG + "model_transaction_policy { decoupled: true }\n")
    dump = tmp_path_factory.mktemp("dump") / "live.json"
    running = RunningServer(repo, module="tests.uncollected", env={"FERRY_LIVE_OBJECTS": str(dump)})
    running.dump = dump
    try:
        yield running
    finally:
        running.stop()


def live_requests(server) -> dict[str, int]:
    server.dump.unlink(missing_ok=True)
    os.kill(server.proc.pid, signal.SIGUSR1)
    wait_for(server.dump.exists, 60, what="the server to count its requests")
    return json.loads(server.dump.read_text())


def test_an_answered_bls_call_keeps_nothing_alive_in_the_server(server):
    for _ in range(2):
        seen = json.loads(kserve.infer(server.channel, "tmem", {"X": np.array([0], np.int32)})["OUT"][0])
        assert seen == [True] * 8
    # Eight calls an execute, twice: each one's request (and the tensors it holds) was freed when its
    # last reference went, not left to a collection that may come minutes later.
    live = live_requests(server)
    assert live.get("tcallee", 0) == 0 and live.get("tstream", 0) == 0, live

"""What Triton's own BLS suite (qa/L0_backend_python/bls, models qa/python_models/bls*) holds a Python
backend to, on a machine without a GPU, with models written for this test:

- `InferenceRequest` needs `model_name`, `inputs` and `requested_output_names` (TypeError without one);
- a call refused before it reaches the called model (no such model, inputs that do not fit) reads as
  Triton's request executor words it: `Model <name> - Error when running inference: <why>`;
- a call whose `timeout=` (microseconds) passes while it waits in the called model's queue fails with
  Triton's `Request timeout expired`, and the called model reads the timeout with `request.timeout()`;
- `to_dlpack()` works on every tensor model code holds: an input too large for the model process's arena
  (it travels in the frame) and a Tensor made from a read-only array;
- the workers of a `multiprocessing.Pool` that execute forks make BLS calls of their own (test_multiprocess);
- model control from initialize works (bls_model_loading): a model loads another while it loads itself;
- BLS in initialize or finalize is refused with Triton's words (bls_init_error, bls_finalize_error): the
  model fails to load, or its finalize's failure is in the log.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import kserve
from tests.conftest import RunningServer, wait_for

# Runs the checks of Triton's bls model that need no GPU; answers what it saw, as JSON.
CALLER = '''
import asyncio
import json
import numpy as np
import triton_python_backend_utils as pb_utils

BIG_TIMEOUT_US = 11000000000


def refused(**kwargs):
    try:
        pb_utils.InferenceRequest(**kwargs)
    except TypeError:
        return True
    return False


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.Tensor("INPUT0", np.ones([1, 4], np.float32))
            seen = {
                "no_model_name": refused(inputs=[], requested_output_names=["OUTPUT0"]),
                "no_inputs": refused(model_name="tident", requested_output_names=["OUTPUT0"]),
                "no_requested": refused(model_name="tident", inputs=[x]),
            }
            unknown = pb_utils.InferenceRequest(model_name="tnope", inputs=[], requested_output_names=[]).exec()
            seen["unknown"] = unknown.error().message() if unknown.has_error() else None
            missing = pb_utils.InferenceRequest(model_name="tident", inputs=[], requested_output_names=["OUTPUT0"]).exec()
            seen["missing_input"] = missing.error().message() if missing.has_error() else None
            # the first call holds tslow's one instance; the second waits in its queue past its 1 ms
            slow = [pb_utils.InferenceRequest(model_name="tslow", inputs=[x], requested_output_names=["TIMEOUT"],
                                              timeout=t).async_exec() for t in (BIG_TIMEOUT_US, 1000)]
            ran, expired = await asyncio.gather(*slow)
            seen["ran_timeout"] = (None if ran.has_error()
                                   else int(pb_utils.get_output_tensor_by_name(ran, "TIMEOUT").as_numpy()[0]))
            seen["expired"] = expired.error().message() if expired.has_error() else None
            readonly = pb_utils.Tensor("R", np.frombuffer(np.arange(3, dtype=np.float32).tobytes(), np.float32))
            try:
                seen["readonly_dlpack"] = pb_utils.Tensor.from_dlpack("R", readonly.to_dlpack()).as_numpy().tolist()
            except Exception as exc:
                seen["readonly_dlpack"] = repr(exc)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([json.dumps(seen).encode()],
                                                                                          np.object_))]))
        return responses
'''
CALLER_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "X", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] }]
"""

# Identity through DLPack, as Triton's dlpack_identity: OUTPUT0 shares INPUT0's memory.
DLPACK_IDENTITY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").to_dlpack())]) for r in requests]
'''
IDENTITY_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [ -1, -1 ] }]
output [{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1, -1 ] }]
"""

# Holds its one instance until the test opens the gate (once the queued call's deadline has fired), then
# answers the timeout it was given. The bound only keeps a failed test's server from hanging.
SLOW = '''
import os
import time
import numpy as np
import triton_python_backend_utils as pb_utils

GATE = {gate!r}


class TritonPythonModel:
    def execute(self, requests):
        bound = time.monotonic() + 120
        while not os.path.exists(GATE) and time.monotonic() < bound:
            time.sleep(0.005)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("TIMEOUT", np.array([r.timeout()], np.int64))])
                for r in requests]
'''
SLOW_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [ -1, -1 ] }]
output [{ name: "TIMEOUT", data_type: TYPE_INT64, dims: [ 1 ] }]
"""


# Execute forks a Pool whose workers each call tident (sync BLS), as Triton's test_multiprocess; half the
# tensors are too large to ride in a frame (answered through the arena), and one worker logs. Answers,
# for each worker's call, whether the answer equalled what was sent.
FORKER = '''
import json
from multiprocessing import Pool
import numpy as np
import triton_python_backend_utils as pb_utils


def call(i):
    x = np.full((1, 4096 if i % 2 else 8), i, np.float32)
    response = pb_utils.InferenceRequest(model_name="tident", inputs=[pb_utils.Tensor("INPUT0", x)],
                                         requested_output_names=["OUTPUT0"]).exec()
    if i == 0:
        pb_utils.Logger.log_info("forked worker called tident")
    if response.has_error():
        return response.error().message()
    return bool(np.array_equal(pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy(), x))


class TritonPythonModel:
    def execute(self, requests):
        with Pool(3) as pool:
            seen = pool.map(call, range(8))
        mine = call(9)  # the parent's own link still works after its children's calls
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([json.dumps(seen + [mine]).encode()],
                                                                             np.object_))]) for _ in requests]
'''


# Calls tident from initialize or from finalize (PHASE), as Triton's bls_init_error and bls_finalize_error.
OUT_OF_EXECUTE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


def call():
    pb_utils.InferenceRequest(model_name="tident", inputs=[pb_utils.Tensor("INPUT0", np.ones((1, 2), np.float32))],
                              requested_output_names=["OUTPUT0"]).exec()


class TritonPythonModel:
    def initialize(self, args):
        if {phase!r} == "initialize":
            call()

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([b"ran"], np.object_))]) for _ in requests]

    def finalize(self):
        if {phase!r} == "finalize":
            call()
'''


# Loads tident from initialize, as Triton's bls_model_loading does, and answers the readiness it saw.
LOADER = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        before = pb_utils.is_model_ready("tident")
        pb_utils.load_model("tident")
        self.seen = [before, pb_utils.is_model_ready("tident")]

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([json.dumps(self.seen).encode()],
                                                                             np.object_))]) for _ in requests]
'''


def write(repo: Path, name: str, source: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write(repo, "tcaller", CALLER, CALLER_CONFIG)
    write(repo, "tident", DLPACK_IDENTITY, IDENTITY_CONFIG)
    write(repo, "tforker", FORKER, CALLER_CONFIG)
    write(repo, "tslow", SLOW.format(gate=str(repo / "gate")), SLOW_CONFIG)
    running = RunningServer(repo)
    running.gate = repo / "gate"
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def seen(server):
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(kserve.infer, server.channel, "tcaller", {"X": np.array([0], np.int32)})
        # tslow's instance is held, so its second call can only leave the queue by its 1 ms deadline
        wait_for(lambda: server.metric("ferry_deadline_misses", model="tslow") == 1, what="tslow's deadline miss")
        server.gate.touch()
        return json.loads(answer.result(timeout=120)["OUT"][0])


def test_inference_request_needs_a_model_name_inputs_and_requested_outputs(seen):
    assert (seen["no_model_name"], seen["no_inputs"], seen["no_requested"]) == (True, True, True)


def test_a_refused_call_reads_as_tritons_request_executor_words_it(seen):
    assert seen["unknown"] == ("Model tnope - Error when running inference: "
                               "Request for unknown model: 'tnope' is not found")
    assert seen["missing_input"].startswith("Model tident - Error when running inference: "
                                            "expected 1 inputs but got 0 inputs for model 'tident'")


def test_a_call_timeout_expires_in_the_queue_and_reaches_the_called_model(seen):
    assert seen["expired"] is not None and "Request timeout expired" in seen["expired"]
    assert seen["ran_timeout"] == 11000000000  # Triton's test_timeout looks for this in the log


def test_to_dlpack_of_a_read_only_tensor(seen):
    assert seen["readonly_dlpack"] == [0.0, 1.0, 2.0]


def test_to_dlpack_of_an_input_too_large_for_the_arena(server):
    big = np.arange(5 * 1024 * 1024, dtype=np.float32).reshape(1, -1)  # 20 MiB: more than the server's half of it
    out = kserve.infer(server.channel, "tident", {"INPUT0": big})["OUTPUT0"]
    np.testing.assert_array_equal(out, big)


def test_bls_from_the_workers_of_a_pool_execute_forks(server):
    for _ in range(2):  # a second execute forks a new pool: its relays are new too
        seen = json.loads(kserve.infer(server.channel, "tforker", {"X": np.array([0], np.int32)})["OUT"][0])
        assert seen == [True] * 9
    assert "forked worker called tident" in server.output


def test_bls_in_initialize_or_finalize_is_refused_as_triton_refuses_it(tmp_path):
    write(tmp_path, "tident", DLPACK_IDENTITY, IDENTITY_CONFIG)
    for phase in ("initialize", "finalize"):
        write(tmp_path, f"t{phase}", OUT_OF_EXECUTE.format(phase=phase), CALLER_CONFIG)
    running = RunningServer(tmp_path)
    try:
        index = {m.name: m for m in kserve.stub(running.channel).RepositoryIndex(pb.RepositoryIndexRequest()).models}
        assert index["tinitialize"].state == "UNAVAILABLE"
        assert "BLS is only supported during the 'execute' function." in index["tinitialize"].reason
        assert index["tfinalize"].state == "READY"
        assert kserve.infer(running.channel, "tfinalize", {"X": np.array([0], np.int32)})["OUT"].tolist() == [b"ran"]
    finally:
        running.stop()
    assert "finalize failed: BLS is only supported during the 'execute' function." in running.output


def test_model_control_from_initialize(tmp_path):
    write(tmp_path, "tident", DLPACK_IDENTITY, IDENTITY_CONFIG)
    write(tmp_path, "tloader", LOADER, CALLER_CONFIG)
    running = RunningServer(tmp_path, "--model-control-mode", "explicit", "--load-model", "tloader")
    try:
        seen = json.loads(kserve.infer(running.channel, "tloader", {"X": np.array([0], np.int32)})["OUT"][0])
        assert seen == [False, True]
        assert kserve.stub(running.channel).ModelReady(pb.ModelReadyRequest(name="tident"), timeout=30).ready
    finally:
        running.stop()

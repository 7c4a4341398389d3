"""Two BLS points of Triton's python_backend README, with Triton-API models written for this test:
a BLS request to a stateful model carries its correlation id and sequence flags
(`InferenceRequest(correlation_id=..., flags=TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)`), so the
sequence model sees one sequence across calls; and a decoupled BLS call's response iterator has
`cancel()`, which cancels the call where it runs (the called model's is_cancelled() turns true); the
iterator then ends when the called model ends its stream, as Triton's does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests import kserve, python_rescheduling_models
from tests.conftest import RunningServer, wait_for

# Calls tseq three times as one sequence (START, -, END) under the correlation id it is given, then once
# under another id, START|END; answers what tseq saw each time, as JSON.
SEQ_BLS = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            cid = int(pb_utils.get_input_tensor_by_name(request, "CID").as_numpy()[0])
            start, end = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START, pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
            seen = []
            for corr, flags in ((cid, start), (cid, 0), (cid, end), (cid + 1, start | end)):
                answer = pb_utils.InferenceRequest(
                    model_name="tseq", inputs=[pb_utils.Tensor("IN", np.array([[1]], np.int32))],
                    requested_output_names=["CID", "FLAGS", "SEEN"], correlation_id=corr, flags=flags).exec()
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
                seen.append([int(pb_utils.get_output_tensor_by_name(answer, n).as_numpy().flat[0])
                             for n in ("CID", "FLAGS", "SEEN")])
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([json.dumps(seen).encode()],
                                                                                          np.object_))]))
        return responses
'''
SEQ_BLS_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "CID", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] }]
"""

# Decoupled: a response every 5 ms until is_cancelled() (60 s at most), then it marks the file named by
# its `flag` parameter and ends.
ENDLESS = '''
import json, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.flag = json.loads(args["model_config"])["parameters"]["flag"]["string_value"]

    def execute(self, requests):
        for request in requests:
            sender, i, end = request.get_response_sender(), 0, time.monotonic() + 60
            while not request.is_cancelled() and time.monotonic() < end:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
                i += 1
                time.sleep(0.005)
            if request.is_cancelled():
                open(self.flag, "w").close()
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
ENDLESS_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }]
model_transaction_policy { decoupled: true }
parameters [{ key: "flag", value: { string_value: "%s" } }]
"""

# Reads two of tendless's responses, cancels the iterator, then drains it: answers (responses read before
# the cancel, the error messages and codes after it) as JSON. `await async_exec` too (ASYNC input 1).
CANCEL_BLS = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(model_name="tendless", inputs=[pb_utils.Tensor("IN", np.array([0], np.int32))],
                                             requested_output_names=["OUT"])
            asynchronous = bool(pb_utils.get_input_tensor_by_name(request, "ASYNC").as_numpy()[0])
            stream = await call.async_exec(decoupled=True) if asynchronous else call.exec(decoupled=True)
            before = [int(pb_utils.get_output_tensor_by_name(next(stream), "OUT").as_numpy()[0]) for _ in range(2)]
            stream.cancel()
            errors = [(r.error().message(), r.error().code()) for r in stream if r.has_error()]
            out = {"before": before, "errors": errors}
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([json.dumps(out).encode()],
                                                                                          np.object_))]))
        return responses
'''
CANCEL_BLS_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "ASYNC", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] }]
"""


def write(repo: Path, name: str, source: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    flag = repo.parent / "tendless.cancelled"
    write(repo, "tseq", python_rescheduling_models.SEQ, python_rescheduling_models.SEQ_CONFIG)
    write(repo, "tseq_bls", SEQ_BLS, SEQ_BLS_CONFIG)
    write(repo, "tendless", ENDLESS, ENDLESS_CONFIG % flag)
    write(repo, "tcancel_iter", CANCEL_BLS, CANCEL_BLS_CONFIG)
    server = RunningServer(repo)
    try:
        yield server, flag
    finally:
        server.stop()


def test_a_bls_request_to_a_stateful_model_carries_its_correlation_id_and_flags(served):
    server, _ = served
    out = kserve.infer(server.channel, "tseq_bls", {"CID": np.array([41], np.int32)})["OUT"]
    # tseq saw one sequence of three requests under 41 (START, -, END), then a one-request sequence under 42
    assert json.loads(out[0]) == [[41, 1, 1], [41, 0, 2], [41, 2, 3], [42, 3, 1]]


@pytest.mark.parametrize("asynchronous", [0, 1])
def test_cancelling_a_decoupled_bls_iterator_cancels_the_call_where_it_runs(served, asynchronous):
    server, flag = served
    flag.unlink(missing_ok=True)
    out = json.loads(kserve.infer(server.channel, "tcancel_iter", {"ASYNC": np.array([asynchronous], np.int32)})["OUT"][0])
    assert out["before"] == [0, 1]
    # tendless honours the cancel by ending its stream with a plain final flag, so the drained iterator
    # ends without an error (Triton's: cancel() tells the called model; the called model decides the end)
    assert out["errors"] == []
    wait_for(flag.exists, 60, "tendless to see is_cancelled()")  # the called model saw it, and stopped
    assert kserve.infer(server.channel, "tseq_bls", {"CID": np.array([7], np.int32)})["OUT"].size == 1  # serving on

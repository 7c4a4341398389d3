"""Triton-API Python models that reschedule their requests (Triton's request rescheduling), written for
Ferry's tests: each keeps its state per correlation id, so requests interleave as a Triton user's would.

- tsteps: iterative sequence, not decoupled, max_batch_size 4. A request asking N runs is rescheduled
  N - 1 times, then answered with RUNS (how many executes it took), FLAGS (the request flags of each
  run), BATCH (the largest execute it was part of) and CID (its correlation id). Every execute waits
  until the gate file exists (the test opens it), and the first one marks that it was entered.
- tcount: iterative sequence, decoupled (the python_backend README's example): input N sends N
  responses, OUT counting down to 0 (the last one FINAL), rescheduling itself between them; FLAGS is
  the request flags of the run that sent the response.
- tplain: dynamic batching, and tplain_stream: decoupled, neither iterative: rescheduling is refused.
- tseq: a sequence model (correlation ids from the client): it answers the correlation id and flags
  it saw and how many requests of the sequence it has seen.
- tthreaded: decoupled, one instance, like NVIDIA's repeat example: execute returns at once and a
  thread sends the rest. A request with ROLE 0 answers 0, then waits (from its thread) until a ROLE 1
  request has run, and ends with 2 (-1 if none came within 60 s); ROLE 1 answers 1 and ends.
- tasync: the same with `async def execute` (Triton 24.04's async execute for decoupled models): ROLE
  0 awaits an asyncio event that a ROLE 1 request sets.
"""

from __future__ import annotations

from pathlib import Path

STEPS = '''
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.gate, self.entered = params["gate"]["string_value"], params["entered"]["string_value"]
        self.state = {}

    def execute(self, requests):
        open(self.entered, "a").close()
        end = time.monotonic() + 600  # the test opens the gate; this only bounds a test that failed
        while not os.path.exists(self.gate) and time.monotonic() < end:
            time.sleep(0.005)
        responses = []
        for request in requests:
            cid, wanted = request.correlation_id(), int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy().flat[0])
            runs, flags, batch = self.state.get(cid, (0, [], 0))
            runs, flags, batch = runs + 1, flags + [request.flags()], max(batch, len(requests))
            if runs < wanted:
                self.state[cid] = (runs, flags, batch)
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
                continue
            self.state.pop(cid, None)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("RUNS", np.array([[runs]], np.int32)),  # [1, ...]: a batched model's rows
                pb_utils.Tensor("FLAGS", np.array([flags], np.int32)),
                pb_utils.Tensor("BATCH", np.array([[batch]], np.int32)),
                pb_utils.Tensor("CID", np.array([[cid]], np.uint64))]))
        return responses
'''
STEPS_CONFIG = """
backend: "python"
max_batch_size: 4
input [{ name: "N", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "RUNS", data_type: TYPE_INT32, dims: [ 1 ] }, { name: "FLAGS", data_type: TYPE_INT32, dims: [ -1 ] },
        { name: "BATCH", data_type: TYPE_INT32, dims: [ 1 ] }, { name: "CID", data_type: TYPE_UINT64, dims: [ 1 ] }]
sequence_batching { iterative_sequence: true }
parameters: { key: "gate", value: { string_value: "%s" } }
parameters: { key: "entered", value: { string_value: "%s" } }
"""

COUNT = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.remaining = {}

    def execute(self, requests):
        for request in requests:
            cid = request.correlation_id()
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                self.remaining[cid] = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().flat[0])
            self.remaining[cid] -= 1
            left = self.remaining[cid]
            response = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([left], np.int32)),
                                                   pb_utils.Tensor("FLAGS", np.array([request.flags()], np.int32))])
            sender = request.get_response_sender()
            if left <= 0:
                del self.remaining[cid]
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                sender.send(response)
        return None
'''
COUNT_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }, { name: "FLAGS", data_type: TYPE_INT32, dims: [ 1 ] }]
sequence_batching { iterative_sequence: true }
"""

PLAIN = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if x[0] < 0:  # asks to run again, which only an iterative sequence model may
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            response = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)])
            if pb_utils.using_decoupled_model_transaction_policy(self.config):
                request.get_response_sender().send(
                    response, flags=0 if x[0] < 0 else pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                responses.append(response)
        return responses or None

    def initialize(self, args):
        import json
        self.config = json.loads(args["model_config"])
'''
PLAIN_CONFIG = """
backend: "python"
max_batch_size: 4
input [{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }]
"""

SEQ = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.seen = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            cid = request.correlation_id()
            self.seen[cid] = self.seen.get(cid, 0) + 1
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("CID", np.array([[cid]], np.uint64)),
                pb_utils.Tensor("FLAGS", np.array([[request.flags()]], np.int32)),
                pb_utils.Tensor("SEEN", np.array([[self.seen[cid]]], np.int32))]))
        return responses
'''
SEQ_CONFIG = """
backend: "python"
max_batch_size: 2
input [{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "CID", data_type: TYPE_UINT64, dims: [ 1 ] }, { name: "FLAGS", data_type: TYPE_INT32, dims: [ 1 ] },
        { name: "SEEN", data_type: TYPE_INT32, dims: [ 1 ] }]
sequence_batching { max_sequence_idle_microseconds: 600000000 }
"""


THREADED = '''
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


def response(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))])


class TritonPythonModel:
    def initialize(self, args):
        self.released = threading.Event()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if pb_utils.get_input_tensor_by_name(request, "ROLE").as_numpy().flat[0] == 0:
                sender.send(response(0))
                threading.Thread(target=self.finish_when_released, args=(sender,), daemon=True).start()
            else:
                self.released.set()
                sender.send(response(1), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finish_when_released(self, sender):
        released = self.released.wait(60)
        sender.send(response(2 if released else -1), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''
THREADED_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [{ name: "ROLE", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }]
instance_group [{ count: 1, kind: KIND_CPU }]
"""


ASYNC = '''
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


def response(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))])


class TritonPythonModel:
    def initialize(self, args):
        self.released = None  # made on the loop that runs execute

    async def execute(self, requests):
        if self.released is None:
            self.released = asyncio.Event()
        for request in requests:
            sender = request.get_response_sender()
            if pb_utils.get_input_tensor_by_name(request, "ROLE").as_numpy().flat[0] == 0:
                sender.send(response(0))
                try:
                    await asyncio.wait_for(self.released.wait(), 60)
                    sender.send(response(2), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except asyncio.TimeoutError:
                    sender.send(response(-1), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                self.released.set()
                sender.send(response(1), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def write(repo: Path, name: str, source: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(config)


def build(repo: Path, gate: Path, entered: Path) -> None:
    write(repo, "tsteps", STEPS, STEPS_CONFIG % (gate, entered))
    write(repo, "tcount", COUNT, COUNT_CONFIG)
    write(repo, "tplain", PLAIN, PLAIN_CONFIG + "dynamic_batching { }\n")
    write(repo, "tplain_stream", PLAIN, PLAIN_CONFIG.replace("max_batch_size: 4", "max_batch_size: 0")
          + "model_transaction_policy { decoupled: true }\n")
    write(repo, "tseq", SEQ, SEQ_CONFIG)
    write(repo, "tthreaded", THREADED, THREADED_CONFIG)
    write(repo, "tasync", ASYNC, THREADED_CONFIG)

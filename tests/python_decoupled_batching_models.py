"""A decoupled Triton-API Python model that batches, written for Ferry's tests (Triton's dynamic batcher
hands a decoupled model's execute every request waiting, each with its own response sender).

- tbatched: decoupled, max_batch_size 4, dynamic_batching with a 50 ms max_queue_delay, one instance; X
  is INT32 [-1]. Every
  execute marks the `entered` file, then waits until the `gate` file exists (the test opens it). Each
  request gets one response, Y = X * 10 and BATCH = how many requests its execute got, then its
  final flag alone; a request whose X is negative gets an error response instead (it fails alone).
  A request with X = [0] answers Y = every X value the model has been given, in the order it saw them.
- tpair: the same model with max_batch_size 2 and a 600 s max_queue_delay (its gate always open): a
  request waits, with the instance free, until a second one fills its batch.
- tqueue: the same model with default_queue_policy { max_queue_size: 1 } and a gate of its own
  (`tqueue.gate` and `tqueue.entered` beside the repository).
- tprio: the same model with max_batch_size 1 (one request per execute), priority_levels 2 (default
  level 2) and a gate of its own (`tprio.gate`, `tprio.entered`).
- tseq_stream: a decoupled stateful model (sequence_batching with START, END, READY and CORRID control
  inputs), two instances, max_batch_size 2. It counts each sequence's requests in its instance and
  answers each request once: the control values it got, that count, its process id and how many
  requests its execute got. tseq_idle: the same with no idle limit set (Triton's default: released after
  one second without a request). An execute sleeps 20 ms so a sequence's requests usually pile up behind each
  other (what would expose a sequence spread over instances); the test's assertions hold whatever the timing.
"""

from __future__ import annotations

from pathlib import Path

BATCHED = '''
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.gate, self.entered = params["gate"]["string_value"], params["entered"]["string_value"]
        self.seen = []

    def execute(self, requests):
        open(self.entered, "a").close()
        end = time.monotonic() + 600  # the test opens the gate; this only bounds a test that failed
        while not os.path.exists(self.gate) and time.monotonic() < end:
            time.sleep(0.005)
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            sender = request.get_response_sender()
            if x.shape == (1, 1) and x[0, 0] == 0:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([self.seen], np.int32)),
                                                        pb_utils.Tensor("BATCH", np.array([[len(requests)]], np.int32))]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            self.seen.extend(int(v) for v in x.flat)
            if (x < 0).any():
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("X must not be negative")),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 10),
                                                    pb_utils.Tensor("BATCH", np.array([[len(requests)]], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
BATCHED_CONFIG = """name: "%s"
backend: "python"
max_batch_size: %d
input [{ name: "X", data_type: TYPE_INT32, dims: [ -1 ] }]
output [{ name: "Y", data_type: TYPE_INT32, dims: [ -1 ] }, { name: "BATCH", data_type: TYPE_INT32, dims: [ 1 ] }]
model_transaction_policy { decoupled: true }
dynamic_batching { max_queue_delay_microseconds: %d%s }
instance_group [{ count: 1, kind: KIND_CPU }]
parameters [{ key: "gate", value: { string_value: "%s" } }, { key: "entered", value: { string_value: "%s" } }]
"""


SEQUENCE = '''
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.counts = {}

    def execute(self, requests):
        time.sleep(0.02)
        for request in requests:
            def value(name):
                return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().flat[0])
            cid = value("CORRID")
            self.counts[cid] = self.counts.get(cid, 0) + 1
            out = [value(n) for n in ("START", "END", "READY")] + [cid, self.counts[cid], os.getpid(), len(requests)]
            request.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([out], np.int64))]),
                                               flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
SEQUENCE_CONFIG = """name: "%s"
backend: "python"
max_batch_size: 2
input [{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "OUT", data_type: TYPE_INT64, dims: [ 7 ] }]
model_transaction_policy { decoupled: true }
instance_group [{ count: 2, kind: KIND_CPU }]
sequence_batching {%s
  control_input [{ name: "START", control [{ kind: CONTROL_SEQUENCE_START, int32_false_true: [0, 1] }] },
                 { name: "END", control [{ kind: CONTROL_SEQUENCE_END, int32_false_true: [0, 1] }] },
                 { name: "READY", control [{ kind: CONTROL_SEQUENCE_READY, int32_false_true: [0, 1] }] },
                 { name: "CORRID", control [{ kind: CONTROL_SEQUENCE_CORRID, data_type: TYPE_UINT64 }] }]
}
"""


def build(repo: Path, gate: Path, entered: Path) -> None:
    """`gate` and `entered`: tbatched's files (tpair's gate is open from the start)."""
    bounded = " default_queue_policy { max_queue_size: 1 }"
    for name, rows, delay_us, queue, gate_file, entered_file in (
            ("tbatched", 4, 50_000, "", gate, entered),
            ("tpair", 2, 600_000_000, "", repo.parent, repo.parent / "tpair.entered"),
            ("tqueue", 4, 0, bounded, repo.parent / "tqueue.gate", repo.parent / "tqueue.entered"),
            ("tprio", 1, 0, " priority_levels: 2 default_priority_level: 2", repo.parent / "tprio.gate",
             repo.parent / "tprio.entered")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(BATCHED)
        (repo / name / "config.pbtxt").write_text(BATCHED_CONFIG % (name, rows, delay_us, queue, gate_file, entered_file))
    for name, idle in (("tseq_stream", "\n  max_sequence_idle_microseconds: 600000000"), ("tseq_idle", "")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(SEQUENCE)
        (repo / name / "config.pbtxt").write_text(SEQUENCE_CONFIG % (name, idle))

"""Triton-API Python models written for Ferry's tests (`class TritonPythonModel`, `pb_utils`), one per API point.

Each writes its folder into a test repository; tests/integration/test_python_triton_api.py serves them.
"""

from __future__ import annotations

from pathlib import Path

# Batching add/sub that reports what it was given: initialize's args, each request's accessors, the
# helpers' answers, and how many requests its execute got. A negative first element gets an error
# response (that request alone); 99 makes execute raise (every request of that execute fails).
ADD = '''
import json, os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        self.config = json.loads(args["model_config"])
        self.out_dtype = pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(self.config, "SUM")["data_type"])
        self.in_dims = pb_utils.get_input_config_by_name(self.config, "INPUT0")["dims"]

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            if a.flat[0] == 99:
                raise ValueError("ninety-nine is not a number this model adds")
            if a.flat[0] < 0:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)))
                continue
            total = pb_utils.Tensor("x", (a + b).astype(self.out_dtype))
            total = pb_utils.Tensor.from_dlpack("SUM", total.to_dlpack())  # through DLPack and back
            info = {
                "args": {k: v for k, v in self.args.items() if k != "model_config"},
                "config_name": self.config["name"], "max_batch_size": self.config["max_batch_size"],
                "in_dims": self.in_dims, "pid": os.getpid(), "requests": len(requests),
                "request_id": request.request_id(), "parameters": json.loads(request.parameters()),
                "requested": request.requested_output_names(), "correlation_id": request.correlation_id(),
                "flags": request.flags(), "is_cancelled": request.is_cancelled(), "is_cpu": total.is_cpu(),
                "fp32": pb_utils.numpy_to_triton_type(np.float32), "to_numpy": pb_utils.triton_to_numpy_type(11).__name__,
                "decoupled": pb_utils.using_decoupled_model_transaction_policy(self.config),
            }
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                total, pb_utils.Tensor("DIFF", (a - b).astype(self.out_dtype)),
                pb_utils.Tensor("INFO", np.array([json.dumps(info).encode()] * len(a), dtype=np.object_).reshape(-1, 1))]))
        return responses

    def is_ready(self):
        return True
'''
ADD_CONFIG = """
name: "tadd"
backend: "python"
max_batch_size: 8
input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "INPUT1", data_type: TYPE_FP32, dims: [ 4 ] }]
output [{ name: "SUM", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "DIFF", data_type: TYPE_FP32, dims: [ 4 ] },
        { name: "INFO", data_type: TYPE_STRING, dims: [ 1 ] }]
dynamic_batching { }
instance_group [{ kind: KIND_CPU }]
"""
# The same model with a window that holds requests until three are there: they meet in one execute.
ADD3_CONFIG = ADD_CONFIG.replace('"tadd"', '"tadd3"').replace(
    "dynamic_batching { }", "dynamic_batching { preferred_batch_size: [ 3 ], max_queue_delay_microseconds: 30000000 }")

# Decoupled: one response per element of IN, sent from a thread after execute returned, then the final flag.
REPEAT = '''
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            threading.Thread(target=self.send, args=(request.get_response_sender(), values), daemon=True).start()
        return None

    def send(self, sender, values):
        for i, v in enumerate(values):
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([v], np.int32)),
                                                    pb_utils.Tensor("IDX", np.array([i], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''
REPEAT_CONFIG = """
name: "trepeat"
backend: "python"
max_batch_size: 0
input [{ name: "IN", data_type: TYPE_INT32, dims: [ -1 ] }]
output [{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }, { name: "IDX", data_type: TYPE_INT32, dims: [ 1 ] }]
model_transaction_policy { decoupled: True }
"""

# Decoupled: sends one response, then waits until its caller goes away, which it records in a gauge.
WAIT = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.seen = pb_utils.MetricFamily("test_cancelled_seen", "Cancellations the model saw",
                                          pb_utils.MetricFamily.GAUGE).Metric(labels={"model": "twait"})

    def execute(self, requests):
        request = requests[0]
        sender = request.get_response_sender()
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.int32))]))
        deadline = time.monotonic() + 120
        while not request.is_cancelled() and time.monotonic() < deadline:
            time.sleep(0.01)
        if request.is_cancelled():
            self.seen.set(1)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
WAIT_CONFIG = REPEAT_CONFIG.replace('"trepeat"', '"twait"').replace(
    ', { name: "IDX", data_type: TYPE_INT32, dims: [ 1 ] }', "")

# BLS: exec to tadd (its SUM only, preferred_memory on the CPU), async_exec to tadd twice at once,
# exec(decoupled=True) to trepeat, a call to a model that does not exist (its error message),
# is_model_ready, and a call that prefers GPU memory (GPU: what refused it, "" where it ran on host tensors).
BLS = '''
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            one = pb_utils.InferenceRequest(model_name="tadd", inputs=[a, b], requested_output_names=["SUM"],
                                            preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)).exec()
            try:  # refused where there is no GPU, before anything is sent
                gpu = pb_utils.InferenceRequest(model_name="tadd", inputs=[a, b], requested_output_names=["SUM"],
                                                preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, 0))
                gpu = "" if gpu.exec().output_tensors()[0].is_cpu() else "not on the host"
            except pb_utils.TritonModelException as exc:
                gpu = exc.message()
            if one.has_error():
                raise pb_utils.TritonModelException(one.error().message())
            pair = await asyncio.gather(*[pb_utils.InferenceRequest(
                model_name="tadd", inputs=[a, b], requested_output_names=["SUM", "DIFF"]).async_exec() for _ in range(2)])
            twice = sum(pb_utils.get_output_tensor_by_name(r, "SUM").as_numpy() for r in pair)
            stream = pb_utils.InferenceRequest(model_name="trepeat", inputs=[pb_utils.Tensor("IN", np.arange(5, dtype=np.int32))],
                                               requested_output_names=["OUT"]).exec(decoupled=True)
            outs = [pb_utils.get_output_tensor_by_name(r, "OUT").as_numpy()[0] for r in stream if r.output_tensors()]
            missing = pb_utils.InferenceRequest(model_name="nope", inputs=[a],
                                                requested_output_names=["X"]).exec()
            ready = [pb_utils.is_model_ready("tadd"), pb_utils.is_model_ready("nope")]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.get_output_tensor_by_name(one, "SUM"),
                pb_utils.Tensor("TWICE", twice.astype(np.float32)),
                pb_utils.Tensor("STREAM", np.array(outs, np.int32)),
                pb_utils.Tensor("MISSING", np.array([missing.error().message().encode()], np.object_)),
                pb_utils.Tensor("MISSING_CODE", np.array([missing.error().code()], np.int32)),
                pb_utils.Tensor("READY", np.array(ready, np.bool_)),
                pb_utils.Tensor("GPU", np.array([gpu.encode()], np.object_))]))
        return responses
'''
BLS_CONFIG = """
name: "tbls"
backend: "python"
max_batch_size: 0
input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 1, 4 ] }, { name: "INPUT1", data_type: TYPE_FP32, dims: [ 1, 4 ] }]
output [{ name: "SUM", data_type: TYPE_FP32, dims: [ 1, 4 ] }, { name: "TWICE", data_type: TYPE_FP32, dims: [ 1, 4 ] },
        { name: "STREAM", data_type: TYPE_INT32, dims: [ -1 ] }, { name: "MISSING", data_type: TYPE_STRING, dims: [ 1 ] },
        { name: "MISSING_CODE", data_type: TYPE_INT32, dims: [ 1 ] }, { name: "READY", data_type: TYPE_BOOL, dims: [ 2 ] },
        { name: "GPU", data_type: TYPE_STRING, dims: [ 1 ] }]
"""

# No config file: auto_complete_config declares everything (and batching).
AUTO = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [2]})
        auto_complete_model_config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [2]})
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 3)])
                for r in requests]
'''

# Custom metrics of the three kinds, and a log line per execute.
METRICS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.count = pb_utils.MetricFamily("test_requests", "Requests seen", pb_utils.MetricFamily.COUNTER).Metric(labels=labels)
        self.last = pb_utils.MetricFamily("test_last_x", "Last x", pb_utils.MetricFamily.GAUGE).Metric(labels=labels)
        self.sizes = pb_utils.MetricFamily("test_x", "x observed", pb_utils.MetricFamily.HISTOGRAM).Metric(
            labels=labels, buckets=[1.0, 10.0])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = float(pb_utils.get_input_tensor_by_name(request, "X").as_numpy().flat[0])
            self.count.increment(1)
            self.last.set(x)
            self.sizes.observe(x)
            pb_utils.Logger.log_info(f"tmetrics saw {x}")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([self.count.value()], np.float32))]))
        return responses
'''
METRICS_CONFIG = """
name: "tmetrics"
backend: "python"
input [{ name: "X", data_type: TYPE_FP32, dims: [ 1 ] }]
output [{ name: "Y", data_type: TYPE_FP32, dims: [ 1 ] }]
"""

ENV_CONFIG = METRICS_CONFIG.replace('"tmetrics"', '"tenv"') + """
parameters: { key: "EXECUTION_ENV_PATH", value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }
"""

# Model control from model code: OP 0 unloads "tadd", 1 loads it; answers is_model_ready("tadd") after.
CONTROL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        op = int(pb_utils.get_input_tensor_by_name(requests[0], "OP").as_numpy()[0])
        if op == 0:
            pb_utils.unload_model("tadd")
        elif op == 1:
            pb_utils.load_model("tadd")
        ready = pb_utils.is_model_ready("tadd")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("READY", np.array([ready], np.bool_))]) for _ in requests]
'''
CONTROL_CONFIG = """
name: "tcontrol"
backend: "python"
input [{ name: "OP", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "READY", data_type: TYPE_BOOL, dims: [ 1 ] }]
"""

# is_ready(): not ready while a file named not_ready sits in its model folder.
READY = '''
import os
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.flag = os.path.join(args["model_repository"], "not_ready")

    async def is_ready(self):
        return not os.path.exists(self.flag)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "X")]) for r in requests]
'''
READY_CONFIG = METRICS_CONFIG.replace('"tmetrics"', '"tready"').replace('name: "Y"', 'name: "X"')


def write(repo: Path, name: str, source: str, config: str | None) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "1" / "model.py").write_text(source)
    if config is not None:
        (repo / name / "config.pbtxt").write_text(config)


def build(repo: Path) -> None:
    write(repo, "tadd", ADD, ADD_CONFIG)
    write(repo, "tadd3", ADD, ADD3_CONFIG)
    write(repo, "trepeat", REPEAT, REPEAT_CONFIG)
    write(repo, "twait", WAIT, WAIT_CONFIG)
    write(repo, "tbls", BLS, BLS_CONFIG)
    write(repo, "tauto", AUTO, None)
    write(repo, "tmetrics", METRICS, METRICS_CONFIG)
    write(repo, "tenv", METRICS, ENV_CONFIG)
    write(repo, "tcontrol", CONTROL, CONTROL_CONFIG)
    write(repo, "tready", READY, READY_CONFIG)

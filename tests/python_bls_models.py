"""Triton-API Python models for response parameters, BLS to a generation model, cancellation that follows
BLS calls, and pb_utils.load_model with a config and files (tests/integration/test_python_bls.py).

Each writes its folder into a test repository; the generation model they call ("tllm") and the gated
ONNX-free model ("tgated", tests/builders.gated_model) are built by the test.
"""

from __future__ import annotations

from pathlib import Path

# Tokens asked of the generation a cancelled request's BLS call runs: no CPU decodes them within the
# test's bounds, so only a working cancel ends it (the test's "tllm" has room for them).
ENDLESS_TOKENS = 60_000

# Response parameters of each kind; a negative X sets a float parameter, which Triton refuses.
PARAMS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])
            out = [pb_utils.Tensor("Y", np.array([x * 2], np.int32))]
            if x < 0:
                responses.append(pb_utils.InferenceResponse(out, parameters={"ratio": 1.5}))  # raises
                continue
            responses.append(pb_utils.InferenceResponse(
                out, parameters={"even": x % 2 == 0, "count": x, "label": f"x={x}"}))
        return responses
'''
PARAMS_CONFIG = """
name: "tparams"
backend: "python"
max_batch_size: 0
input [{ name: "X", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "Y", data_type: TYPE_INT32, dims: [ 1 ] }]
"""

# Decoupled: N responses, each with its own parameters, then the final flag.
PARAMS_STREAM = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(n):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([i], np.int32))],
                                                       parameters={"index": i, "last": i == n - 1, "tag": "stream"}))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
PARAMS_STREAM_CONFIG = PARAMS_CONFIG.replace('"tparams"', '"tparams_stream"') + \
    "model_transaction_policy { decoupled: True }\n"

# BLS: what response.parameters() says for the two models above, as JSON in OUT.
PARAMS_BLS = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            one = pb_utils.InferenceRequest(model_name="tparams", inputs=[x], requested_output_names=["Y"]).exec()
            stream = pb_utils.InferenceRequest(model_name="tparams_stream", inputs=[x],
                                               requested_output_names=["Y"]).exec(decoupled=True)
            seen = {"one": json.loads(one.parameters()), "stream": [json.loads(r.parameters()) for r in stream]}
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([json.dumps(seen).encode()], np.object_))]))
        return responses
'''
PARAMS_BLS_CONFIG = """
name: "tparams_bls"
backend: "python"
max_batch_size: 0
input [{ name: "X", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] }]
"""

# BLS to the generation model "tllm" as Triton users call Triton's vLLM models: exec() for the whole
# text, exec(decoupled=True) with stream=True for the pieces. Greedy, MAX tokens, eos ignored.
GEN_BLS = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


def call(prompt, stream, max_tokens):
    sampling = json.dumps({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
    inputs = [pb_utils.Tensor("text_input", np.array([prompt], np.object_)),
              pb_utils.Tensor("stream", np.array([stream], np.bool_)),
              pb_utils.Tensor("sampling_parameters", np.array([sampling.encode()], np.object_))]
    return pb_utils.InferenceRequest(model_name="tllm", inputs=inputs, requested_output_names=["text_output"])


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()[0]
            max_tokens = int(pb_utils.get_input_tensor_by_name(request, "MAX").as_numpy()[0])
            whole = call(prompt, False, max_tokens).exec()
            if whole.has_error():
                raise pb_utils.TritonModelException(whole.error().message())
            pieces, finish, count = [], None, 0
            for response in call(prompt, True, max_tokens).exec(decoupled=True):
                count += 1
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                text = pb_utils.get_output_tensor_by_name(response, "text_output")
                if text is not None:
                    pieces.append(text.as_numpy()[0])
                finish = json.loads(response.parameters()).get("finish_reason", finish)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.get_output_tensor_by_name(whole, "text_output"),
                pb_utils.Tensor("PIECES", np.array(pieces, np.object_)),
                pb_utils.Tensor("COUNT", np.array([count], np.int32)),
                pb_utils.Tensor("FINISH", np.array([(finish or "").encode()], np.object_))]))
        return responses
'''
GEN_BLS_CONFIG = """
name: "tgen_bls"
backend: "python"
max_batch_size: 0
input [{ name: "PROMPT", data_type: TYPE_STRING, dims: [ 1 ] }, { name: "MAX", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "text_output", data_type: TYPE_STRING, dims: [ -1 ] }, { name: "PIECES", data_type: TYPE_STRING, dims: [ -1 ] },
        { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] }, { name: "FINISH", data_type: TYPE_STRING, dims: [ 1 ] }]
"""

# BLS whose callers go away: MODE 0 calls the gated model "tgated" (queued behind a request the test
# holds), MODE 1 streams a generation of `max_tokens` (the config's) from "tllm", eos ignored, and
# marks `<flag>.streaming` at its first piece.
# What each BLS call ended with (its error code, or "ok") is counted in `test_bls_outcome`. Decoupled
# ("tcancel_bls_stream"), it answers through its response sender.
CANCEL_BLS = '''
import json, os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.flag = config["parameters"]["flag"]["string_value"]
        self.max_tokens = int(config["parameters"]["max_tokens"]["string_value"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.outcome = pb_utils.MetricFamily("test_bls_outcome", "How the BLS calls of cancelled requests ended",
                                             pb_utils.MetricFamily.COUNTER)

    def execute(self, requests):
        request = requests[0]
        mode = int(pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0])
        if mode == 0:
            called = pb_utils.InferenceRequest(model_name="tgated", inputs=[pb_utils.Tensor("X", np.ones((1, 2), np.float32))],
                                               requested_output_names=["Y"]).exec()
            self.count(called, request)
        else:
            sampling = json.dumps({"temperature": 0, "max_tokens": self.max_tokens, "ignore_eos": True})
            inputs = [pb_utils.Tensor("text_input", np.array([b"the ferry leaves"], np.object_)),
                      pb_utils.Tensor("stream", np.array([True], np.bool_)),
                      pb_utils.Tensor("sampling_parameters", np.array([sampling.encode()], np.object_))]
            for response in pb_utils.InferenceRequest(model_name="tllm", inputs=inputs, requested_output_names=["text_output"]).exec(decoupled=True):
                open(self.flag + ".streaming", "w").close()
                if response.has_error():
                    self.count(response, request)
                    break
        response = pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([mode], np.int32))])
        if not self.decoupled:
            return [response]
        request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def count(self, response, request):
        code = str(response.error().code()) if response.has_error() else "ok"
        self.outcome.Metric(labels={"code": code, "seen_cancelled": str(request.is_cancelled())}).increment(1)
'''


def cancel_bls_config(flag: Path, name: str = "tcancel_bls", decoupled: bool = False) -> str:
    return f"""
name: "{name}"
model_transaction_policy {{ decoupled: {decoupled} }}
backend: "python"
max_batch_size: 0
input [{{ name: "MODE", data_type: TYPE_INT32, dims: [ 1 ] }}]
output [{{ name: "Y", data_type: TYPE_INT32, dims: [ 1 ] }}]
parameters: {{ key: "flag", value: {{ string_value: "{flag}" }} }}
parameters: {{ key: "max_tokens", value: {{ string_value: "{ENDLESS_TOKENS}" }} }}
"""


# Model control with an override: loads NAME with CONFIG (a JSON config), and with FILE as its
# 1/model.onnx when FILE is not empty; answers is_model_ready(NAME), or the error's message.
LOADER = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        request = requests[0]
        name, config, onnx = (pb_utils.get_input_tensor_by_name(request, key).as_numpy()[0]
                              for key in ("NAME", "CONFIG", "FILE"))
        try:
            if onnx:
                pb_utils.load_model(model_name=name.decode(), config=config.decode(), files={"file:1/model.onnx": onnx})
            else:
                pb_utils.load_model(name.decode(), config=config.decode())
            said = "ready" if pb_utils.is_model_ready(name.decode()) else "not ready"
        except pb_utils.TritonModelException as exc:
            said = exc.message()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SAID", np.array([said.encode()], np.object_))])]
'''
LOADER_CONFIG = """
name: "tloader"
backend: "python"
max_batch_size: 0
input [{ name: "NAME", data_type: TYPE_STRING, dims: [ 1 ] }, { name: "CONFIG", data_type: TYPE_STRING, dims: [ 1 ] },
       { name: "FILE", data_type: TYPE_STRING, dims: [ 1 ] }]
output [{ name: "SAID", data_type: TYPE_STRING, dims: [ 1 ] }]
"""


def write(repo: Path, name: str, source: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(config)


def build(repo: Path, flag: Path) -> None:
    write(repo, "tparams", PARAMS, PARAMS_CONFIG)
    write(repo, "tparams_stream", PARAMS_STREAM, PARAMS_STREAM_CONFIG)
    write(repo, "tparams_bls", PARAMS_BLS, PARAMS_BLS_CONFIG)
    write(repo, "tgen_bls", GEN_BLS, GEN_BLS_CONFIG)
    write(repo, "tcancel_bls", CANCEL_BLS, cancel_bls_config(flag))
    write(repo, "tcancel_bls_stream", CANCEL_BLS, cancel_bls_config(flag, "tcancel_bls_stream", True))
    write(repo, "tloader", LOADER, LOADER_CONFIG)

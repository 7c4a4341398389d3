"""Tiny Triton-API Python models for the behaviours Triton's own QA suite (qa/L0_backend_python) pins
down: instance names, error codes and texts, response senders of models that are not decoupled,
async BLS to a decoupled model, models without inputs, FORCE_CPU_ONLY_INPUT_TENSORS. Written from
scratch for Ferry's tests; `build(repo)` writes them into a model repository."""

from __future__ import annotations

from pathlib import Path



def _io(dtype: str, out_dtype: str = "") -> str:
    return (f'input [ {{ name: "IN" data_type: {dtype} dims: [ 1 ] }} ]\n'
            f'output [ {{ name: "OUT" data_type: {out_dtype or dtype} dims: [ 1 ] }} ]\n')


_CONFIGS = {
    "qa_name": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_FP32", "TYPE_STRING"),
    "qa_code": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_STRING"),
    "qa_raise": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_FP32"),
    "qa_sender": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_STRING"),
    "qa_stream": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_STRING")
    + "model_transaction_policy { decoupled: true }\n",
    "qa_meet": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_STRING")
    + "model_transaction_policy { decoupled: true }\n",
    "qa_async_bls": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_STRING")
    + "model_transaction_policy { decoupled: true }\n",
    "qa_args": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_FP32", "TYPE_STRING"),
    "qa_argv": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_FP32", "TYPE_STRING"),
    "qa_ready_int": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_FP32"),
    "qa_ready_slow": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_FP32"),
    "qa_resched_returns": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_FP32")
    + "sequence_batching { iterative_sequence: true }\n",
    "qa_package": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_FP32"),
    "qa_no_inputs": 'backend: "python"\nmax_batch_size: 0\noutput [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n',
    "qa_optional": 'backend: "python"\nmax_batch_size: 0\n'
    'input [ { name: "A" data_type: TYPE_FP32 dims: [ 1 ] optional: true } ]\n'
    'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n',
    "qa_gpu_inputs": 'backend: "python"\nmax_batch_size: 0\n' + _io("TYPE_FP32")
    + 'parameters: { key: "FORCE_CPU_ONLY_INPUT_TENSORS" value: { string_value: "no" } }\n',
}

_HEAD = "import json\nimport threading\nimport numpy as np\nimport triton_python_backend_utils as pb_utils\n\n\n"

_MODELS = {
    # answers with the instance name initialize was given
    "qa_name": """
class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_instance_name"]

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([self.name], np.object_))])
                for _ in requests]
""",
    # answers with the pb_utils.TritonError named by IN (no code given: the default)
    "qa_code": """
class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0].decode()
            if name == "default":
                error = pb_utils.TritonError("no code given")
            else:
                error = pb_utils.TritonError("code " + name, getattr(pb_utils.TritonError, name))
            responses.append(pb_utils.InferenceResponse(error=error))
        return responses
""",
    # raises from execute
    "qa_raise": """
class TritonPythonModel:
    def execute(self, requests):
        raise ValueError("qa_raise cannot take " + str(len(requests)) + " request(s)")
""",
    # not decoupled, answering through the response sender as IN says:
    #   late: returns None, sends one response (then the final flag) from a thread after execute returned
    #   final_first: sends the final flag before any response
    #   twice: sends two responses, the second refused (its message is logged)
    #   both: sends one response and returns another for the same request
    "qa_sender": """
def _out(text):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([text], np.object_))])


class TritonPythonModel:
    def execute(self, requests):
        returned = []
        for request in requests:
            how = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0].decode()
            sender = request.get_response_sender()
            returned.append(None)
            if how == "late":
                started = threading.Event()

                def later(sender=sender, started=started):
                    started.wait()
                    sender.send(_out("sent after execute returned"))
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

                threading.Thread(target=later, daemon=True).start()
                threading.Timer(0.2, started.set).start()
            elif how == "final_first":
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            elif how == "twice":
                sender.send(_out("first"))
                try:
                    sender.send(_out("second"))
                except pb_utils.TritonModelException as exc:
                    pb_utils.Logger.log_info("qa_sender refused: " + str(exc))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            elif how == "both":
                sender.send(_out("from the sender"), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                returned[-1] = _out("returned")
        return returned if any(r is not None for r in returned) else None
""",
    # decoupled: "return" returns a response (refused); "closed" sends with the final flag, then again
    "qa_stream": """
class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            how = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0].decode()
            if how == "return":
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array(["x"], np.object_))])]
            sender = request.get_response_sender()
            out = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array(["once"], np.object_))])
            sender.send(out, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            try:
                sender.send(out)
            except pb_utils.TritonModelException as exc:
                pb_utils.Logger.log_info("qa_stream refused: " + str(exc))
        return None
""",
    # decoupled, called by qa_async_bls: request "A" waits (in a thread) until request "B" reached this
    # model, then both answer with one response carrying the final flag
    "qa_meet": """
class TritonPythonModel:
    def initialize(self, args):
        self.b_arrived = threading.Event()

    def execute(self, requests):
        for request in requests:
            who = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0].decode()
            sender = request.get_response_sender()
            if who == "B":
                self.b_arrived.set()
            threading.Thread(target=self._answer, args=(sender, who), daemon=True).start()
        return None

    def _answer(self, sender, who):
        text = who
        if who == "A":
            text = "A met B" if self.b_arrived.wait(30) else "A never met B"
        out = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([text], np.object_))])
        sender.send(out, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
""",
    # async decoupled: forwards each response of an awaited decoupled BLS call to qa_meet
    "qa_async_bls": """
class TritonPythonModel:
    async def execute(self, requests):
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "IN")
            call = pb_utils.InferenceRequest(model_name="qa_meet", inputs=[pb_utils.Tensor("IN", tensor.as_numpy())],
                                             requested_output_names=["OUT"])
            responses = await call.async_exec(decoupled=True)
            sender = request.get_response_sender()
            for response in responses:
                out = pb_utils.get_output_tensor_by_name(response, "OUT")
                text = out.as_numpy()[0].decode() if out is not None else "an empty response"
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([text], np.object_))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
""",
    # what each call with an argument of the wrong type raises (Triton's bindings: TypeError, or
    # TritonModelException for a list element that is not a Tensor)
    "qa_args": """
def _raised(call):
    try:
        call()
    except Exception as exc:
        return type(exc).__name__
    return "nothing"


class TritonPythonModel:
    def execute(self, requests):
        t = pb_utils.Tensor("X", np.array([1], np.int32))
        calls = {
            "request_inputs_none": lambda: pb_utils.InferenceRequest(model_name="m", inputs=None,
                                                                     requested_output_names=["Y"]),
            "request_input_element": lambda: pb_utils.InferenceRequest(model_name="m", inputs=[None],
                                                                       requested_output_names=["Y"]),
            "request_model_name": lambda: pb_utils.InferenceRequest(model_name=None, inputs=[t],
                                                                    requested_output_names=["Y"]),
            "request_outputs": lambda: pb_utils.InferenceRequest(model_name="m", inputs=[t],
                                                                 requested_output_names=[None]),
            "request_flags": lambda: pb_utils.InferenceRequest(model_name="m", inputs=[t],
                                                               requested_output_names=["Y"], flags=None),
            "request_ok": lambda: pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[],
                                                            correlation_id="c-1"),
            "response_none": lambda: pb_utils.InferenceResponse(output_tensors=None),
            "response_element": lambda: pb_utils.InferenceResponse(output_tensors=[None]),
            "response_ok": lambda: pb_utils.InferenceResponse(output_tensors=[]),
            "tensor_name": lambda: pb_utils.Tensor(None, np.array([1])),
            "tensor_data": lambda: pb_utils.Tensor("X", None),
            "dlpack_none": lambda: pb_utils.Tensor.from_dlpack("X", None),
            "log_level_int": lambda: pb_utils.Logger.log("message", 1),
            "log_none": lambda: pb_utils.Logger.log_info(None),
            "log_ok": lambda: pb_utils.Logger.log("message"),
            "log_alias": lambda: pb_utils.Logger.log("message", pb_utils.Logger.INFO),
        }
        raised = json.dumps({name: _raised(call) for name, call in calls.items()})
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([raised], np.object_))])
                for _ in requests]
""",
    # what model code sees as sys.argv (Triton's stub gives it no arguments)
    "qa_argv": """
import sys


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([json.dumps(sys.argv[1:])], np.object_))])
                for _ in requests]
""",
    # is_ready answers 1, not True: not ready, as in Triton
    "qa_ready_int": """
class TritonPythonModel:
    def is_ready(self):
        return 1

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.float32))]) for _ in requests]
""",
    # is_ready counts its calls in GATES/ready_calls and waits until GATES/open exists
    "qa_ready_slow": """
import os
import time


class TritonPythonModel:
    def is_ready(self):
        calls = os.path.join(GATES, "ready_calls")
        with open(calls, "a") as f:
            f.write("x")
        while not os.path.exists(os.path.join(GATES, "open")):
            time.sleep(0.05)
        return True

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([2], np.float32))]) for _ in requests]
""",
    # reschedules its request and returns a response for it too: Triton's error
    "qa_resched_returns": """
class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.float32))]) for _ in requests]
""",
    # imports a file of its folder relatively, as Triton's multi_file QA model does
    "qa_package": """
from . import qa_helper


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([qa_helper.VALUE], np.float32))])
                for _ in requests]
""",
    "qa_no_inputs": """
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([len(r.inputs())], np.float32))])
                for r in requests]
""",
    "qa_optional": """
class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "A")
            value = a.as_numpy() if a is not None else np.array([-1], np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value)]))
        return responses
""",
    "qa_gpu_inputs": """
class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "IN")
            value = tensor.as_numpy() * (2 if tensor.is_cpu() else 0)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value)]))
        return responses
""",
}


def build(repo: Path, gates: Path) -> None:
    """`gates`: a folder the test and qa_ready_slow share (its is_ready waits there)."""
    for name, config in _CONFIGS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
        head = _HEAD + f"GATES = {str(gates)!r}\n\n\n"
        (repo / name / "1" / "model.py").write_text(head + _MODELS[name].lstrip("\n"))
    (repo / "qa_package" / "1" / "qa_helper.py").write_text("VALUE = 7.0\n")

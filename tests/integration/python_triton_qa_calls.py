"""Run by test_python_triton_qa.py in its own process (tritonclient's protobuf messages cannot share a
process with Ferry's): the models of tests/python_triton_qa_models.py called with tritonclient, gRPC and
HTTP, as a Triton user calls them. Prints JSON: what each call got (outputs, or status and message)."""

import json
import queue
import sys
from pathlib import Path

import numpy as np
import tritonclient.grpc as tc
import tritonclient.http as th
from tritonclient.utils import InferenceServerException


def text_input(module, value: str):
    t = module.InferInput("IN", [1], "BYTES")
    t.set_data_from_numpy(np.array([value.encode()], np.object_))
    return t


def fp32_input(module, name: str, value: float):
    t = module.InferInput(name, [1], "FP32")
    t.set_data_from_numpy(np.array([value], np.float32))
    return t


def outcome(call):
    """{"out": [...]} or {"status": ..., "message": ...}."""
    try:
        result = call()
    except InferenceServerException as exc:
        return {"status": str(exc.status()), "message": exc.message()}
    out = result.as_numpy("OUT")
    return {"out": [v.decode() if isinstance(v, bytes) else float(v) for v in out.tolist()]}


def stream(url: str, model: str, values: list[str], headers=None, wait_s: float = 60, until_error=False) -> list[dict]:
    """Each value sent as one request on one ModelStreamInfer stream; what came back, in order, until
    the stream is closed by the client (after `len(values)` answers or `wait_s`)."""
    got: queue.Queue = queue.Queue()
    client = tc.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: got.put((result, error)), headers=headers)
    for value in values:
        client.async_stream_infer(model, [text_input(tc, value)])
    answers = []
    while len(answers) < len(values):
        try:
            result, error = got.get(timeout=wait_s)
        except queue.Empty:
            break  # no more within wait_s: the caller's assertions count what came
        if error is not None:
            answers.append({"status": str(error.status()), "message": error.message()})
            if until_error:
                break
        else:
            answers.append({"out": [v.decode() for v in result.as_numpy("OUT").tolist()]})
    client.stop_stream()
    while not got.empty():  # whatever came after: an extra response would show here
        result, error = got.get_nowait()
        answers.append({"status": str(error.status()) if error else None,
                        "out": None if result is None else [v.decode() for v in result.as_numpy("OUT").tolist()]})
    client.close()
    return answers


def slow_readiness(g, h, gates: Path) -> dict:
    """qa_ready_slow's is_ready waits for a gate: the first check times out (not ready), a request is
    answered meanwhile, and once the gate opens the next check gets the answer of the one in flight."""
    first = h.is_model_ready("qa_ready_slow")
    served = outcome(lambda: g.infer("qa_ready_slow", [fp32_input(tc, "IN", 1)], client_timeout=30))
    (gates / "open").touch()
    second = g.is_model_ready("qa_ready_slow")
    return {"first": first, "served": served, "second": second, "calls": len((gates / "ready_calls").read_text())}


def main(grpc_url: str, http_url: str, gates: Path) -> dict:
    g, h = tc.InferenceServerClient(grpc_url), th.InferenceServerClient(http_url)
    result = {"name": outcome(lambda: g.infer("qa_name", [fp32_input(tc, "IN", 1)]))}
    codes = ["UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS",
             "CANCELLED", "default"]
    result["codes_grpc"] = {c: outcome(lambda c=c: g.infer("qa_code", [text_input(tc, c)])) for c in codes}
    result["codes_http"] = {c: outcome(lambda c=c: h.infer("qa_code", [text_input(th, c)])) for c in codes}
    result["raise_grpc"] = outcome(lambda: g.infer("qa_raise", [fp32_input(tc, "IN", 1)]))
    result["raise_http"] = outcome(lambda: h.infer("qa_raise", [fp32_input(th, "IN", 1)]))
    result["sender"] = {how: outcome(lambda how=how: g.infer("qa_sender", [text_input(tc, how)]))
                        for how in ("late", "final_first", "twice", "both")}
    result["stream_return"] = stream(grpc_url, "qa_stream", ["return"])
    result["stream_closed"] = stream(grpc_url, "qa_stream", ["closed"])
    result["async_bls"] = stream(grpc_url, "qa_async_bls", ["A", "B"])
    result["args"] = outcome(lambda: g.infer("qa_args", [fp32_input(tc, "IN", 1)]))
    result["argv"] = outcome(lambda: g.infer("qa_argv", [fp32_input(tc, "IN", 1)]))
    result["ready_int"] = [h.is_model_ready("qa_ready_int"), g.is_model_ready("qa_ready_int")]
    result["ready_slow"] = slow_readiness(g, h, gates)
    result["resched_returns"] = outcome(lambda: g.infer("qa_resched_returns", [fp32_input(tc, "IN", 1)],
                                                        client_timeout=20))
    result["package"] = outcome(lambda: g.infer("qa_package", [fp32_input(tc, "IN", 1)]))
    result["no_inputs_grpc"] = outcome(lambda: g.infer("qa_no_inputs", []))
    result["no_inputs_http"] = outcome(lambda: h.infer("qa_no_inputs", []))
    result["optional_http"] = {"none": outcome(lambda: h.infer("qa_optional", [])),
                               "given": outcome(lambda: h.infer("qa_optional", [fp32_input(th, "A", 7)]))}
    result["gpu_inputs"] = outcome(lambda: g.infer("qa_gpu_inputs", [fp32_input(tc, "IN", 3)]))
    result["grpc_error_stream"] = stream(grpc_url, "qa_code", ["INVALID_ARG", "UNKNOWN"],
                                         headers={"triton_grpc_error": "true"}, until_error=True)
    result["plain_error_stream"] = stream(grpc_url, "qa_code", ["INVALID_ARG", "UNKNOWN"])
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))))

"""Run by test_python_bls.py in its own process (tritonclient's protobuf messages cannot share a process
with Ferry's): the models of tests/python_bls_models.py called as Triton users call them. Prints JSON.

`python python_bls_calls.py GRPC_ADDRESS HTTP_ADDRESS WHAT [ARGS...]`; `cancel` and `deadline` talk
over stdin/stdout: they print `sent`, wait for a line, then cancel (or let the deadline pass) and print
the outcome."""

import json
import queue
import sys

import numpy as np
import tritonclient.grpc as tc
import tritonclient.http as th
from tritonclient.utils import InferenceServerException


def tensor(module, name, array, datatype):
    t = module.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def params_of(response) -> dict:
    return {key: getattr(value, value.WhichOneof("parameter_choice")) for key, value in response.parameters.items()}


def stream(client, model, inputs, **kwargs) -> list:
    """Every response of one streamed request, as (outputs, parameters), until the final one."""
    received = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    client.async_stream_infer(model, inputs, request_id="s1", enable_empty_final_response=True, **kwargs)
    out = []
    while True:
        result, err = received.get(timeout=120)
        if err is not None:
            raise err
        response = result.get_response()
        outputs = {o.name: result.as_numpy(o.name).tolist() for o in response.outputs}
        out.append((_decoded(outputs), params_of(response)))
        if response.parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    return out


def _decoded(outputs: dict) -> dict:
    return {k: [v.decode() if isinstance(v, bytes) else v for v in values] for k, values in outputs.items()}


def params(grpc_url: str, http_url: str) -> dict:
    client = tc.InferenceServerClient(grpc_url)
    x = lambda module, v: [tensor(module, "X", np.array([v], np.int32), "INT32")]  # noqa: E731
    answer = client.infer("tparams", x(tc, 4))
    out = {"grpc": params_of(answer.get_response()), "grpc_y": answer.as_numpy("Y").tolist()}
    try:
        client.infer("tparams", x(tc, -1))
    except InferenceServerException as exc:
        out["refused"] = {"status": exc.status(), "message": exc.message()}
    http = th.InferenceServerClient(http_url)
    out["http"] = http.infer("tparams", x(th, 3)).get_response().get("parameters")
    out["http_none"] = "parameters" in http.infer("tparams_bls", x(th, 1)).get_response()
    out["stream"] = stream(client, "tparams_stream", x(tc, 3))
    out["bls"] = json.loads(client.infer("tparams_bls", x(tc, 2)).as_numpy("OUT")[0])
    return out


def generate(grpc_url: str, prompt: str, max_tokens: int) -> dict:
    client = tc.InferenceServerClient(grpc_url)
    bls = client.infer("tgen_bls", [tensor(tc, "PROMPT", np.array([prompt.encode()], np.object_), "BYTES"),
                                    tensor(tc, "MAX", np.array([max_tokens], np.int32), "INT32")])
    out = {"bls": {name: _decoded({name: bls.as_numpy(name).tolist()})[name]
                   for name in ("text_output", "PIECES", "COUNT", "FINISH")}}
    sampling = json.dumps({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
    for streaming in (False, True):  # Triton's vLLM client's request, straight to the generation model
        inputs = [tensor(tc, "text_input", np.array([prompt.encode()], np.object_), "BYTES"),
                  tensor(tc, "stream", np.array([streaming], np.bool_), "BOOL"),
                  tensor(tc, "sampling_parameters", np.array([sampling.encode()], np.object_), "BYTES")]
        out["direct_stream" if streaming else "direct"] = [
            outputs.get("text_output", [None])[0] for outputs, _ in stream(tc.InferenceServerClient(grpc_url), "tllm", inputs)
            if outputs]
    return out


def cancel(grpc_url: str, mode: int, how: str) -> dict:
    """One call to tcancel_bls left by its caller: cancelled (`cancel`) or its deadline passed (`deadline`)."""
    client = tc.InferenceServerClient(grpc_url)
    done = queue.Queue()
    inputs = [tensor(tc, "MODE", np.array([mode], np.int32), "INT32")]
    timeout = {"client_timeout": 600} if how == "cancel" else {"client_timeout": 5}
    context = client.async_infer("tcancel_bls", inputs, lambda result, error: done.put((result, error)), **timeout)
    print("sent", flush=True)
    if how == "cancel":
        sys.stdin.readline()
        context.cancel()
    result, error = done.get(timeout=120)
    return {"error": str(error) if error is not None else None, "answered": result is not None}


def cancel_stream(grpc_url: str) -> dict:
    """One streamed request to tcancel_bls_stream, its stream cancelled by the client."""
    client = tc.InferenceServerClient(grpc_url)
    received = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    client.async_stream_infer("tcancel_bls_stream", [tensor(tc, "MODE", np.array([0], np.int32), "INT32")])
    print("sent", flush=True)
    sys.stdin.readline()
    client.stop_stream(cancel_requests=True)
    answered = False
    while not received.empty():
        result, _ = received.get()
        answered = answered or result is not None
    return {"answered": answered}


def load(grpc_url: str, name: str, config: str, onnx_path: str) -> dict:
    client = tc.InferenceServerClient(grpc_url)
    onnx = open(onnx_path, "rb").read() if onnx_path else b""
    said = client.infer("tloader", [tensor(tc, "NAME", np.array([name.encode()], np.object_), "BYTES"),
                                    tensor(tc, "CONFIG", np.array([config.encode()], np.object_), "BYTES"),
                                    tensor(tc, "FILE", np.array([onnx], np.object_), "BYTES")])
    out = {"said": said.as_numpy("SAID")[0].decode()}
    if out["said"] == "ready":
        out["config"] = client.get_model_config(name, as_json=True)["config"]
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        answer = client.infer(name, [tensor(tc, "INPUT0", a, "FP32"), tensor(tc, "INPUT1", np.ones((2, 4), np.float32), "FP32")])
        out["sum"] = answer.as_numpy("OUTPUT0").tolist()
    return out


def main(argv: list[str]) -> None:
    grpc_url, http_url, what, *args = argv
    if what == "params":
        out = params(grpc_url, http_url)
    elif what == "generate":
        out = generate(grpc_url, args[0], int(args[1]))
    elif what == "cancel":
        out = cancel(grpc_url, int(args[0]), args[1])
    elif what == "cancel_stream":
        out = cancel_stream(grpc_url)
    else:
        out = load(grpc_url, *args)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

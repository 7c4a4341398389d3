"""Run by test_python_based_backends.py in its own process (tritonclient's protobuf messages cannot share
a process with Ferry's): the models served by one Python-based backend, called with tritonclient as a
Triton user calls them. Prints JSON.

Arguments: gRPC address."""

import json
import queue
import sys

import numpy as np
import tritonclient.grpc as tc


def infer(client, model, values, version=""):
    data = np.array([values], dtype=np.float32)
    given = tc.InferInput("IN", list(data.shape), "FP32")
    given.set_data_from_numpy(data)
    result = client.infer(model, [given], model_version=version)
    return {"out": result.as_numpy("OUT").tolist(), "args": json.loads(result.as_numpy("ARGS").reshape(-1)[0].decode())}


def stream(client, model, values):
    """A decoupled model: one response per value, then the final flag."""
    got = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    data = np.array([values], dtype=np.float32)
    given = tc.InferInput("IN", list(data.shape), "FP32")
    given.set_data_from_numpy(data)
    client.async_stream_infer(model, [given], enable_empty_final_response=True)
    out = []
    while True:
        result, error = got.get(timeout=60)
        if error is not None:
            out.append(str(error))
            break
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
        out.append(result.as_numpy("OUT").tolist())
    client.stop_stream()
    return out


def main() -> None:
    client = tc.InferenceServerClient(sys.argv[1])
    client.load_model("double", config=json.dumps({"backend": "scale", "version_policy": {"latest": {"num_versions": 2}}}))
    client.load_model("triple")
    client.load_model("stream")
    print(json.dumps({
        "ready": [client.is_model_ready("double", "1"), client.is_model_ready("double", "2"),
                  client.is_model_ready("triple")],
        "double_1": infer(client, "double", [1, 2, 3], "1"),
        "double_2": infer(client, "double", [1, 2, 3], "2"),
        "triple": infer(client, "triple", [1, 2]),
        "config_double": client.get_model_config("double", as_json=True)["config"],
        "config_triple": client.get_model_config("triple", as_json=True)["config"],
        "stream": stream(client, "stream", [1, 2]),
    }))


if __name__ == "__main__":
    main()

"""Run by test_ensemble_batch_dims.py in its own process (tritonclient's protobuf messages cannot share
a process with Ferry's): each case sent to an ensemble and to its steps one by one, through
tritonclient gRPC and HTTP, printed as JSON. argv: gRPC address, HTTP address."""

import json
import sys

import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException


def attempt(fn, *args) -> dict:
    """fn(*args), or the error's status and message."""
    try:
        return fn(*args)
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}


def infer(client, module, model: str, tensors: dict[str, np.ndarray], output: str) -> dict:
    inputs = []
    for name, value in tensors.items():
        tensor = module.InferInput(name, list(value.shape), "FP32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    result = client.infer(model, inputs, outputs=[module.InferRequestedOutput(output)])
    value = result.as_numpy(output)
    return {"shape": list(value.shape), "value": value.tolist()}


def by_hand_flat(client, module, x: np.ndarray) -> dict:
    """`flat`'s steps run one by one, each shaped as its model declares."""
    a = infer(client, module, "onnx_b", {"X": x[None]}, "Y")
    b = infer(client, module, "py_n", {"X": np.array(a["value"], np.float32)[0]}, "Y")
    c = infer(client, module, "py_b", {"X": np.array(b["value"], np.float32)[None]}, "Y")
    return {"shape": c["shape"][1:], "value": c["value"][0]}


def by_hand_table(client, module, x: np.ndarray) -> dict:
    a = infer(client, module, "onnx_b", {"X": x}, "Y")
    return infer(client, module, "py_n2", {"X": np.array(a["value"], np.float32).reshape(x.shape)}, "Y")


def cases(client, module) -> dict:
    out = {}
    for label, x in (("three", np.array([1, -2, 3.5], np.float32)), ("one", np.array([4], np.float32)),
                     ("empty", np.zeros([0], np.float32))):
        out[f"flat_{label}"] = {"ensemble": attempt(infer, client, module, "flat", {"IN": x}, "OUT"),
                                "by_hand": attempt(by_hand_flat, client, module, x)}
    for label, x in (("rows2", np.arange(8, dtype=np.float32).reshape(2, 4)),
                     ("row1", np.arange(4, dtype=np.float32).reshape(1, 4)), ("rows0", np.zeros([0, 4], np.float32))):
        out[f"table_{label}"] = {"ensemble": attempt(infer, client, module, "table", {"IN": x}, "OUT"),
                                 "by_hand": attempt(by_hand_table, client, module, x)}
    for model, shape, names in (("onnx_b", [0, 3], "XY"), ("onnx_b", [1, 0], "XY"), ("py_b", [0, 2], "XY"),
                                ("py_b", [2, 0], "XY"), ("py_n", [0], "XY"), ("torch_b", [0, 4], "xy")):
        key = f"zero_{model}_{'x'.join(map(str, shape))}"
        out[key] = attempt(infer, client, module, model, {names[0]: np.zeros(shape, np.float32)}, names[1])
    return out


def main() -> None:
    grpc_address, http_address = sys.argv[1:3]
    found = {"grpc": cases(tgrpc.InferenceServerClient(grpc_address), tgrpc),
             "http": cases(thttp.InferenceServerClient(http_address), thttp)}
    print(json.dumps(found))


if __name__ == "__main__":
    main()

"""Run by test_http_classification.py in its own process (tritonclient's `inference.*` messages cannot share a
process with Ferry's): the same classification requests through tritonclient.http (binary and JSON outputs)
and tritonclient.grpc, as image_client.py -c N sends them.

argv: gRPC address, HTTP address; prints {case: {"grpc": ..., "http_binary": ..., "http_json": ...}}.
"""

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def image_batch(batched: bool) -> np.ndarray:
    image = np.random.default_rng(0).random((3, 4, 4), dtype=np.float32)
    return np.stack([image, image[::-1]]) if batched else image


def ask(module, client, model: str, k: int, **output_options):
    data = image_batch(model == "densenet_batched")
    tensor = module.InferInput("data_0", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    output = module.InferRequestedOutput("fc6_1", class_count=k, **output_options)
    try:
        found = client.infer(model, [tensor], outputs=[output]).as_numpy("fc6_1")
    except InferenceServerException as exc:
        return {"error": exc.message(), "status": str(exc.status())}
    # JSON BYTES come back as str from tritonclient.http (as from Triton), binary ones as bytes
    return {"shape": list(found.shape), "classes": [v.decode() if isinstance(v, bytes) else v for v in found.reshape(-1).tolist()]}


def main() -> None:
    grpc_address, http_address = sys.argv[1], sys.argv[2]
    cases = {"top3": ("densenet_onnx", 3), "batched_top2": ("densenet_batched", 2), "all": ("densenet_onnx", 20),
             "zero": ("densenet_onnx", 0), "negative": ("densenet_onnx", -1)}
    answers = {}
    with grpcclient.InferenceServerClient(grpc_address) as g, httpclient.InferenceServerClient(http_address) as h:
        for case, (model, k) in cases.items():
            if k == 0:  # tritonclient drops class_count=0 (no classification asked): send the parameter raw
                answers[case] = {"http_json": raw_zero(h)}
                continue
            answers[case] = {"grpc": ask(grpcclient, g, model, k), "http_binary": ask(httpclient, h, model, k),
                             "http_json": ask(httpclient, h, model, k, binary_data=False)}
    print(json.dumps(answers))


def raw_zero(client) -> dict:
    data = image_batch(False)
    body = {"inputs": [{"name": "data_0", "shape": list(data.shape), "datatype": "FP32", "data": data.reshape(-1).tolist()}],
            "outputs": [{"name": "fc6_1", "parameters": {"classification": 0}}]}
    answer = client._post("v2/models/densenet_onnx/infer", json.dumps(body), {}, None)
    return {"status": answer.status_code, "body": json.loads(answer.read())}


if __name__ == "__main__":
    main()

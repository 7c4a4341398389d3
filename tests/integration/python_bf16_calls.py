"""tritonclient's side of test_python_bf16.py (a subprocess: tritonclient.http brings gevent).

argv: gRPC address, HTTP address. Prints one JSON object."""

from __future__ import annotations

import json
import sys

import ml_dtypes
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

VALUES = np.array([[1.5, -2.25], [0.0078125, 1e38]], dtype=ml_dtypes.bfloat16)  # 1e38: near bfloat16's top, still finite doubled


def _http(address: str, binary: bool) -> dict:
    with httpclient.InferenceServerClient(address) as client:
        given = httpclient.InferInput("X", list(VALUES.shape), "BF16")
        given.set_data_from_numpy(VALUES)  # tritonclient sends BF16 as binary only, as Triton takes it
        outputs = [httpclient.InferRequestedOutput("Y", binary_data=binary), httpclient.InferRequestedOutput("SEEN")]
        result = client.infer("bf16_double", [given], outputs=outputs)
        y = result.get_output("Y")
        answer = {"datatype": y["datatype"], "seen": json.loads(result.as_numpy("SEEN").reshape(-1)[0])}
        if binary:
            array = result.as_numpy("Y")
            answer.update(dtype=str(array.dtype), values=array.astype(np.float32).tolist())
        else:
            answer["values"] = y["data"]
        return answer


def _grpc(address: str) -> dict:
    client = grpcclient.InferenceServerClient(address)
    given = grpcclient.InferInput("X", list(VALUES.shape), "BF16")
    given.set_data_from_numpy(VALUES)
    result = client.infer("bf16_double", [given])
    array = result.as_numpy("Y")
    return {"dtype": str(array.dtype), "values": array.astype(np.float32).tolist(),
            "datatype": result.get_output("Y").datatype}


def main() -> None:
    grpc_address, http_address = sys.argv[1:3]
    print(json.dumps({"http_binary": _http(http_address, True), "http_json": _http(http_address, False),
                      "grpc": _grpc(grpc_address)}))


if __name__ == "__main__":
    main()

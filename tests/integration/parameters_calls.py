"""Run by test_parameters_forwarding.py in its own process (tritonclient's protobuf messages cannot share a
process with Ferry's): request parameters and forwarded headers as each model saw them, through
tritonclient gRPC and HTTP, printed as JSON. argv: gRPC address, HTTP address."""

import json
import sys

import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

OUTPUTS = {"echo": ["SEEN"], "pair": ["FIRST", "SECOND"], "bls": ["SEEN"]}


def seen(client, module, model: str, parameters: dict, headers: dict) -> dict:
    x = module.InferInput("X", [1], "FP32")
    x.set_data_from_numpy(np.ones(1, np.float32))
    try:
        result = client.infer(model, [x], parameters=parameters, headers=headers)
    except InferenceServerException as exc:
        return {"error": exc.message()}
    return {name: json.loads(result.as_numpy(name)[0]) for name in OUTPUTS[model]}


def main() -> None:
    grpc_address, http_address = sys.argv[1:3]
    params = {"color": "blue", "count": 3, "on": True}
    headers = {"fwd-trace": "abc ", "other": "no"}
    out = {}
    for door, module, client in (("grpc", tgrpc, tgrpc.InferenceServerClient(grpc_address)),
                                 ("http", thttp, thttp.InferenceServerClient(http_address))):
        out[door] = {model: seen(client, module, model, params, headers) for model in OUTPUTS}
        out[door]["reserved"] = {name: seen(client, module, "echo", {}, {"fwd-x": "1", name: "2"}) for name in ("triton_fwd", "priority")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

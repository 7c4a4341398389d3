"""Run by test_embeddings.py in its own process (tritonclient's protobuf messages cannot share a process
with Ferry's): KServe infer of an embedding model with tritonclient, over gRPC and HTTP, as a Triton user
sends texts. argv: gRPC address, HTTP address, model, a JSON list of texts, a JSON object of parameters.
Prints JSON: each door's vectors, or its error's status and message."""

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def call(module, address: str, model: str, texts: list[str], parameters: dict) -> dict:
    client = module.InferenceServerClient(address)
    text = module.InferInput("text", [len(texts), 1], "BYTES")
    text.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    try:
        answer = client.infer(model, [text], parameters=parameters or None).as_numpy("embedding")
        return {"dtype": str(answer.dtype), "vectors": answer.tolist()}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"status": str(exc.status()), "message": exc.message()}


def main() -> None:
    grpc_address, http_address, model, texts, parameters = sys.argv[1:6]
    texts, parameters = json.loads(texts), json.loads(parameters)
    config = httpclient.InferenceServerClient(http_address).get_model_config(model)
    print(json.dumps({"grpc": call(grpcclient, grpc_address, model, texts, parameters),
                      "http": call(httpclient, http_address, model, texts, parameters), "config": config}))


if __name__ == "__main__":
    main()

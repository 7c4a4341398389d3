"""Run by test_kserve_sdk.py in its own process: KServe's SDK carries its own copy of the v2 proto, whose
`inference.*` messages cannot share a descriptor pool with Ferry's or tritonclient's.

argv: HTTP url, gRPC address. Calls KServe's v2 REST client (binary and JSON tensors), its gRPC client,
its generated v2 stubs (metadata) and validates the REST bodies as KServe's own pydantic data models;
prints one JSON object of what each call answered (arrays as lists).
"""

import asyncio
import json
import sys

import grpc
import httpx
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig
from kserve.protocol.grpc import grpc_predict_v2_pb2 as kpb
from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc as kpb_grpc
from kserve.protocol.infer_type import RequestedOutput
from kserve.protocol.rest import v2_datamodels as v2

A = np.arange(8, dtype=np.float32).reshape(2, 4)
B = np.full((2, 4), 0.5, np.float32)


def sdk_request(binary: bool, outputs=()) -> InferRequest:
    inputs = []
    for name, array in (("INPUT0", A), ("INPUT1", B)):
        tensor = InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    return InferRequest("simple", inputs, request_id="sdk-1",
                        request_outputs=[RequestedOutput(n, {"binary_data": binary}) for n in outputs] or None)


def answered(response) -> dict:
    return {"id": response.id, "outputs": {o.name: o.as_numpy().tolist() for o in response.outputs}}


async def rest_calls(url: str, binary: bool) -> dict:
    client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0))
    try:
        response = await client.infer(url, sdk_request(binary, ("OUTPUT0", "OUTPUT1")), model_name="simple")
        return {"live": await client.is_server_live(url), "ready": await client.is_server_ready(url),
                "model_ready": await client.is_model_ready(url, "simple"),
                "broken_ready": await client.is_model_ready(url, "broken"), **answered(response)}
    finally:
        await client.close()


async def grpc_calls(address: str) -> dict:
    client = InferenceGRPCClient(address, retries=0)
    try:
        response = await client.infer(sdk_request(binary=True))
        return {"live": await client.is_server_live(), "ready": await client.is_server_ready(),
                "model_ready": await client.is_model_ready("simple"),
                "broken_ready": await client.is_model_ready("broken"), **answered(response)}
    finally:
        await client.close()


def rest_models(url: str) -> dict:
    """The SDK has no metadata call: each body must validate as the model KServe's own server sends."""
    models = {"live": ("/v2/health/live", v2.ServerLiveResponse), "ready": ("/v2/health/ready", v2.ServerReadyResponse),
              "model_ready": ("/v2/models/simple/ready", v2.ModelReadyResponse),
              "broken_ready": ("/v2/models/broken/ready", None),
              "server": ("/v2", v2.ServerMetadataResponse), "model": ("/v2/models/simple", v2.ModelMetadataResponse)}
    out = {}
    for key, (path, model) in models.items():
        answer = httpx.get(url + path, timeout=30)
        body = answer.json()
        out[key] = {"status": answer.status_code,
                    "body": model.model_validate(body).model_dump(mode="json") if model else body}
    return out


def grpc_metadata(address: str) -> dict:
    with grpc.insecure_channel(address) as channel:
        api = kpb_grpc.GRPCInferenceServiceStub(channel)
        meta = api.ServerMetadata(kpb.ServerMetadataRequest(), timeout=30)
        model = api.ModelMetadata(kpb.ModelMetadataRequest(name="simple"), timeout=30)
        try:
            api.ModelMetadata(kpb.ModelMetadataRequest(name="nope"), timeout=30)
            unknown = "OK"
        except grpc.RpcError as exc:
            unknown = exc.code().name
        return {"name": meta.name, "extensions": list(meta.extensions), "unknown": unknown,
                "outputs": [[t.name, t.datatype, list(t.shape)] for t in model.outputs]}


def main() -> None:
    url, address = sys.argv[1], sys.argv[2]
    print(json.dumps({"rest_binary": asyncio.run(rest_calls(url, True)), "rest_json": asyncio.run(rest_calls(url, False)),
                      "grpc": asyncio.run(grpc_calls(address)), "rest_models": rest_models(url),
                      "grpc_metadata": grpc_metadata(address)}))


if __name__ == "__main__":
    main()

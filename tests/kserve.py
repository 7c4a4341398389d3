"""Building KServe v2 requests with Ferry's generated stubs (the test side of the wire)."""

from __future__ import annotations

import numpy as np

from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from server import datatypes
from server.rpc.codec import to_raw

TYPED_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


def stub(channel) -> pb_grpc.GRPCInferenceServiceStub:
    return pb_grpc.GRPCInferenceServiceStub(channel)


def request(model: str, inputs: dict[str, np.ndarray], typed: bool = False, outputs=(), version: str = "",
            request_id: str = "", **params) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, array in inputs.items():
        api = datatypes.from_numpy(array.dtype).api
        tensor = req.inputs.add(name=name, datatype=api, shape=array.shape)
        if typed:
            values = array.reshape(-1).tolist()
            getattr(tensor.contents, TYPED_FIELD[api]).extend(values)
        else:
            req.raw_input_contents.append(to_raw(array))
    for name in outputs:
        req.outputs.add(name=name)
    for key, value in params.items():
        if isinstance(value, bool):
            req.parameters[key].bool_param = value
        elif isinstance(value, int):
            req.parameters[key].int64_param = value
        else:
            req.parameters[key].string_param = str(value)
    return req


def outputs(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """Decode raw outputs the way tritonclient does: by position in `outputs`."""
    result = {}
    for i, tensor in enumerate(response.outputs):
        dtype = datatypes.BY_API[tensor.datatype]
        raw = response.raw_output_contents[i]
        if dtype.api == "BYTES":
            items, offset = [], 0
            while offset < len(raw):
                n = int.from_bytes(raw[offset:offset + 4], "little")
                items.append(raw[offset + 4:offset + 4 + n])
                offset += 4 + n
            array = np.array(items, dtype=object)
        else:
            array = np.frombuffer(raw, dtype=dtype.numpy)
        result[tensor.name] = array.reshape(tuple(tensor.shape))
    return result


def infer(channel, model: str, inputs: dict[str, np.ndarray], **kwargs) -> dict[str, np.ndarray]:
    return outputs(stub(channel).ModelInfer(request(model, inputs, **kwargs), timeout=60))

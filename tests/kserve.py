"""Building KServe v2 requests with Ferry's generated stubs (the test side of the wire)."""

from __future__ import annotations

import numpy as np

from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from server.tensors import datatypes
from server.doors.grpc.codec import to_raw

# One tensor per KServe datatype numpy can hold, with each type's extremes.
ALL_TYPES = {
    "BOOL": np.array([[True, False, True]]), "UINT8": np.array([[0, 7, 255]], np.uint8),
    "UINT16": np.array([[0, 9, 65535]], np.uint16), "UINT32": np.array([[0, 1, 2**32 - 1]], np.uint32),
    "UINT64": np.array([[0, 1, 2**64 - 1]], np.uint64), "INT8": np.array([[-128, 0, 127]], np.int8),
    "INT16": np.array([[-32768, 1, 32767]], np.int16), "INT32": np.array([[-(2**31), 2, 2**31 - 1]], np.int32),
    "INT64": np.array([[-(2**63), 3, 2**63 - 1]], np.int64), "FP16": np.array([[0.5, -2.0, 65504]], np.float16),
    "FP32": np.array([[1.5, -0.25, 3e38]], np.float32), "FP64": np.array([[1e-300, 2.0, -1e300]], np.float64),
    "BYTES": np.array([[b"ascii", "é ü".encode(), b""]], dtype=object),
}


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

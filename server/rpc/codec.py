"""KServe v2 protobuf tensors <-> numpy (raw bytes through server/tensors.py, shared with HTTP).

Raw contents become numpy views over the received bytes (no copy, no per-element Python work);
typed contents are read by numpy straight from protobuf's repeated fields (np.fromiter, no
intermediate list). BYTES is the one exception: each element is its own Python object, so it is
parsed element by element.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from protos import grpc_service_pb2 as pb
from server import datatypes, tensors
from server.errors import InvalidInputError
from server.names import shown
from server.tensors import to_raw

# Typed-contents field for each API datatype (FP16 and BF16 have none: raw only).
_TYPED_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
    "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
    "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
# Request parameters Triton reserves; anything else named triton_* is refused like Triton does.
_RESERVED_TRITON_KEYS = {"triton_enable_empty_final_response"}
_NARROW_INTS = {"INT8", "INT16", "UINT8", "UINT16"}



def decode_inputs(request: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    raw = request.raw_input_contents
    typed = next((t.name for t in request.inputs if t.HasField("contents")), None) if raw else None
    if typed is not None:  # Triton's words first: its example clients match on them
        raise InvalidInputError(
            f"contents field must not be specified when using raw_input_contents for {shown(typed)} for model "
            f"{shown(request.model_name)}: send every input raw or every input typed"
        )
    if raw and len(raw) != len(request.inputs):
        raise InvalidInputError(
            f"request has {len(request.inputs)} inputs but {len(raw)} raw_input_contents entries; send one per input, in order"
        )
    inputs = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name in inputs:
            raise InvalidInputError(f"input {shown(tensor.name)} appears twice in the request")
        dtype = datatypes.BY_API.get(tensor.datatype)
        if dtype is None:
            raise InvalidInputError(
                f"input {shown(tensor.name)} has unknown datatype {shown(tensor.datatype)}; use one of {sorted(datatypes.BY_API)}"
            )
        shape = tensors.checked_shape(tensor.name, tuple(tensor.shape))
        if raw:
            inputs[tensor.name] = tensors.from_raw(tensor.name, dtype, shape, raw[i])
        else:
            inputs[tensor.name] = _from_typed(tensor, dtype, shape)
    return inputs


def _from_typed(tensor, dtype: datatypes.DataType, shape: tuple) -> np.ndarray:
    field = _TYPED_FIELD.get(dtype.api)
    if field is None:
        raise InvalidInputError(f"input {shown(tensor.name)}: datatype {dtype.api} can only be sent as raw_input_contents")
    values = getattr(tensor.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidInputError(
            f"input {shown(tensor.name)}: contents.{field} has {len(values)} elements but shape {list(shape)} needs {count}"
        )
    if dtype.api == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
    elif dtype.api in _NARROW_INTS:  # carried in 32-bit fields: check the range instead of wrapping silently
        wide = np.fromiter(values, dtype=np.int64, count=count)
        info = np.iinfo(dtype.numpy)
        if count and (wide.min() < info.min or wide.max() > info.max):
            raise InvalidInputError(f"input {shown(tensor.name)}: values outside the {dtype.api} range [{info.min}, {info.max}]")
        array = wide.astype(dtype.numpy)
    else:
        array = np.fromiter(values, dtype=dtype.numpy, count=count)
    return array.reshape(shape)


def decode_parameters(params) -> dict[str, Any]:
    out = {}
    for key, param in params.items():
        if key.startswith("triton_") and key not in _RESERVED_TRITON_KEYS:
            raise InvalidInputError(f"parameter {shown(key)} is reserved (names starting with 'triton_')")
        which = param.WhichOneof("parameter_choice")
        out[key] = getattr(param, which) if which else None
    return out


def encode_response(
    request: pb.ModelInferRequest, version: int, outputs: dict[str, np.ndarray], order: tuple[str, ...]
) -> pb.ModelInferResponse:
    """Build the reply with raw contents only (tritonclient never reads typed numeric outputs)."""
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=str(version), id=request.id)
    for name in order:
        array = outputs[name]
        response.outputs.add(name=name, datatype=datatypes.from_numpy(array.dtype).api, shape=array.shape)
        response.raw_output_contents.append(to_raw(array))
    return response

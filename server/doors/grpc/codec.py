"""KServe v2 protobuf tensors <-> numpy (raw bytes through server/tensors/wire.py, shared with HTTP).

Raw contents become numpy views over the received bytes (no copy, no per-element Python work);
typed contents are read by numpy straight from protobuf's repeated fields (np.fromiter, no
intermediate list). BYTES is the one exception: each element is its own Python object, so it is
parsed element by element.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from protos import grpc_service_pb2 as pb
from server.tensors import datatypes
from server.tensors import shared_memory
from server.tensors import wire as tensors
from server.errors import InvalidInputError
from server.names import shown
from server.request import parameters_of
from server.tensors.wire import to_raw

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
_BY_API = datatypes.BY_API
_InputTensor = pb.ModelInferRequest.InferInputTensor
_PLANNED_HEADER_BYTES = 256  # longer tensor headers (a long name, many dims) are decoded in full, never kept


def decode_inputs(request: pb.ModelInferRequest, read_shared=None) -> dict[str, np.ndarray]:
    """`read_shared(tensor, dtype, shape)`: the array of an input that names a shared memory region, or
    None when it names none. As Triton, raw_input_contents carry only the inputs not in shared memory, in order."""
    raw = request.raw_input_contents
    if raw:
        inputs = _plain_raw(request.inputs, raw)
        if inputs is not None:
            return inputs
    sent = list(request.inputs)  # each tensor's wrapper built once, for both passes
    if raw:
        _check_raw_entries(request, sent, raw)
    inputs, index = {}, 0
    for tensor in sent:
        name = tensor.name
        if name in inputs:
            raise InvalidInputError(f"input {shown(name)} appears twice in the request")
        dtype = _BY_API.get(tensor.datatype)
        if dtype is None:
            raise InvalidInputError(
                f"input {shown(name)} has unknown datatype {shown(tensor.datatype)}; use one of {sorted(datatypes.BY_API)}"
            )
        shape = tensors.checked_shape(name, tuple(tensor.shape))
        # Only a tensor with parameters can name a region: most have none, and skip the reader's call.
        from_region = read_shared(tensor, dtype, shape) if read_shared is not None and tensor.parameters else None
        if from_region is not None:
            inputs[name] = from_region
        elif raw:
            inputs[name] = tensors.from_raw(name, dtype, shape, raw[index])
            index += 1
        else:
            inputs[name] = _from_typed(tensor, dtype, shape)
    return inputs


def _check_raw_entries(request: pb.ModelInferRequest, sent: list, raw) -> None:
    """Raw contents come for every input not in shared memory, one entry each, and typed contents for none."""
    inline = 0
    for t in sent:
        if t.HasField("contents"):  # Triton's words first: its example clients match on them
            raise InvalidInputError(
                f"contents field must not be specified when using raw_input_contents for {shown(t.name)} for model "
                f"{shown(request.model_name)}: send every input raw or every input typed"
            )
        if shared_memory.REGION not in t.parameters:
            inline += 1
    if len(raw) != inline:
        raise InvalidInputError(
            f"request has {inline} inputs sent in the request but {len(raw)} raw_input_contents entries; send one "
            "per input not in shared memory, in order"
        )


def _plain_raw(sent, raw) -> dict[str, np.ndarray] | None:
    """The usual request decoded from what each tensor's metadata was found to mean before (`_raw_plan`): every
    input raw, none naming a region, each tensor's bytes the size its shape says. None for anything else, which
    the full decode then accepts or refuses with its own message."""
    if len(sent) != len(raw):
        return None
    inputs = {}
    for tensor, data in zip(sent, raw):
        header = tensor.SerializeToString()
        plan = _raw_plan(header) if len(header) <= _PLANNED_HEADER_BYTES else None
        if plan is None or len(data) != plan[3]:
            return None
        name = plan[0]
        if name in inputs:
            return None
        inputs[name] = np.ndarray(plan[2], plan[1], data)  # a read-only view over the received bytes, as frombuffer's
    return inputs


@functools.lru_cache(maxsize=4096)
def _raw_plan(metadata: bytes) -> tuple[str, np.dtype, tuple[int, ...], int] | None:
    """(name, numpy dtype, shape, byte size) of a raw tensor whose metadata (name, datatype, shape: the tensor
    message without contents) serializes to `metadata`; None where the full decode must look (parameters,
    typed contents, BYTES, an unknown datatype or a refused shape). Clients send the same few tensor headers
    over and over: their checks run once per header instead of once per request. Bounded in entries and, by
    _PLANNED_HEADER_BYTES, in their size: a client varying its headers only evicts entries, and one sending
    megabyte names holds no memory here."""
    tensor = _InputTensor.FromString(metadata)
    dtype = _BY_API.get(tensor.datatype)
    if tensor.parameters or tensor.HasField("contents") or dtype is None or dtype.api == "BYTES":
        return None
    try:
        shape = tensors.checked_shape(tensor.name, tuple(tensor.shape))
    except InvalidInputError:
        return None
    return tensor.name, dtype.numpy, shape, math.prod(shape) * dtype.itemsize


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
    if not params:  # most requests carry none; a map's items() goes through the Mapping ABC
        return {}
    out = {}
    for key, param in params.items():
        if key.startswith("triton_") and key not in _RESERVED_TRITON_KEYS:
            raise InvalidInputError(f"parameter {shown(key)}: parameter keys starting with 'triton_' are reserved for Triton "
                                    "usage and should not be specified.")
        which = param.WhichOneof("parameter_choice")
        out[key] = getattr(param, which) if which else None
    return out


def set_parameter(param: pb.InferParameter, value: bool | int | float | str) -> None:
    """An InferParameter from a parameter's value (bool before int: a bool is an int)."""
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = str(value)


def encode_response(
    request: pb.ModelInferRequest, version: int, outputs: dict[str, np.ndarray], order: tuple[str, ...],
    shared: dict | None = None,
) -> pb.ModelInferResponse:
    """Build the reply with raw contents only (tritonclient never reads typed numeric outputs).

    `shared`: output name -> (Region, Placement) for outputs asked into shared memory. Those are written
    there and answered, as Triton does, with their metadata and the region's parameters; their
    raw_output_contents entry stays empty so the others keep their positions (tritonclient reads by index)."""
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=str(version), id=request.id)
    for key, value in parameters_of(outputs).items():  # the model's response parameters (Triton's Python API)
        set_parameter(response.parameters[key], value)
    for name in order:
        array = outputs[name]
        tensor = response.outputs.add(name=name, datatype=datatypes.from_numpy(array.dtype).api, shape=array.shape)
        if shared and name in shared:
            for key, value in shared_memory.write_output(shared[name], array).items():
                if isinstance(value, str):
                    tensor.parameters[key].string_param = value
                else:
                    tensor.parameters[key].int64_param = value
            response.raw_output_contents.append(b"")
        else:
            response.raw_output_contents.append(to_raw(array))
    return response

"""KServe v2 JSON tensors and Triton's binary tensor data extension <-> numpy.

A request body is a JSON header, optionally followed by raw tensor bytes (its length in the
`Inference-Header-Content-Length` header). An input with `parameters.binary_data_size` is a numpy
view over its slice of those bytes (server/tensors/wire.py, the same parser gRPC raw contents use); an
input with `data` is converted by numpy from the JSON list, checked for kind and range, never cast
silently. An input whose parameters name a system shared memory region (`shared_memory_region`,
`shared_memory_byte_size`, `shared_memory_offset`: Triton's names, checked by the same rules as on
gRPC) is copied out of it. Outputs go back binary when asked (`binary_data`, or `binary_data_output`
for all), JSON lists otherwise, or into the region a requested output names.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.tensors import datatypes

from server.tensors import wire as tensors
from server.doors.http.body import BodyTooLargeError
from server.errors import InvalidInputError
from server.tensors.shared_memory import Placement, SharedMemoryRegistry, placement, write_output
from server.names import capped, shown
from server.request import parameters_of

MAX_JSON_DEPTH = 100  # Triton's HTTP_MAX_JSON_NESTING_DEPTH, for a tensor's `data`

# Which numpy kinds a JSON list may parse into, per target kind: ints never from floats, bools only from bools.
_ACCEPTED_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}


@dataclass(slots=True)
class DecodedInfer:
    inputs: dict[str, np.ndarray]
    requested: tuple[str, ...]
    binary_outputs: dict[str, bool]  # per requested output; absent: `binary_default`
    binary_default: bool
    parameters: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    placements: list[Placement] = field(default_factory=list)  # requested outputs to write into shared memory
    # requested outputs asked for as classes: (name, {"classification": k}), what doors.shared.class_counts reads
    classes: tuple[tuple[str, dict], ...] = ()
    input_regions: list[str] = field(default_factory=list)  # the regions inputs were read from


def split_body(body: bytes, header_length: str | None) -> tuple[dict, memoryview]:
    """The JSON header as a dict, and the binary tail (empty when there is none)."""
    view = memoryview(body)
    length = len(body)
    if header_length is not None:
        if not header_length.isascii() or not header_length.isdigit() or int(header_length) > len(body):
            raise InvalidInputError(f"Inference-Header-Content-Length {shown(header_length)} must be an integer "
                                    f"within [0, {len(body)}] (the body's length)")
        length = int(header_length)
    header = parse_json(view[:length])
    if not isinstance(header, dict):
        raise InvalidInputError(f"the inference request must be a JSON object, got {type(header).__name__}")
    return header, view[length:]


def parse_json(data, object_pairs_hook=None) -> Any:
    try:
        return json.loads(bytes(data), object_pairs_hook=object_pairs_hook)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"the request body is not valid JSON: {capped(str(exc), 200)}") from None
    except RecursionError:  # nested deeper than the parser's stack: a client's body, never a server fault
        raise InvalidInputError("the request body is not valid JSON: JSON nesting depth exceeds maximum allowed limit") from None


def decode_infer(header: dict, binary: memoryview, regions: SharedMemoryRegistry | None = None,
                 limit: int | None = None) -> DecodedInfer:
    """`limit`: the most bytes the inputs sent as JSON `data` may decode to (None: no limit)."""
    given = header.get("inputs")
    if not isinstance(given, list):  # empty for a model whose inputs are all optional (or that has none), as Triton
        raise InvalidInputError("the inference request needs 'inputs': a list of tensors")
    inputs: dict[str, np.ndarray] = {}
    input_regions: list[str] = []
    offset = expanded = 0
    for tensor in given:
        name, dtype, shape, params = _tensor_fields(tensor)
        if name in inputs:
            raise InvalidInputError(f"input {shown(name)} appears twice in the request")
        where = placement(name, params)
        size = params.get("binary_data_size")
        if where is not None:
            inputs[name] = _shared(regions).read(where, dtype, shape)
            input_regions.append(where.region)
        elif size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise InvalidInputError(f"input {shown(name)}: binary_data_size {capped(repr(size), 40)} does not fit the "
                                        f"{len(binary) - offset} binary bytes left in the body")
            inputs[name] = tensors.from_raw(name, dtype, shape, binary[offset : offset + size])
            offset += size
        elif "data" in tensor:
            expanded += math.prod(shape) * (dtype.itemsize or 1)  # known before a byte is converted
            if limit is not None and expanded > limit:
                raise BodyTooLargeError(f"request size of {expanded} bytes with input {shown(name)} exceeds the maximum "
                                        f"allowed input size of {limit} bytes (JSON data counted as decoded; "
                                        "--http-max-input-size)")
            inputs[name] = _from_json(name, dtype, shape, tensor["data"])
        else:
            raise InvalidInputError(f"input {shown(name)} has neither 'data' nor parameters.binary_data_size")
    if offset != len(binary):
        raise InvalidInputError(f"{len(binary) - offset} bytes of binary data are left over after the inputs that claim them")
    params = _parameters(header.get("parameters"))
    binary_default = params.pop("binary_data_output", False)
    requested, binary_outputs, placements, classes = _outputs(header.get("outputs"))
    if placements:
        _shared(regions)
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInputError(f"'id' must be a string, got {type(request_id).__name__}")
    return DecodedInfer(inputs, requested, binary_outputs, bool(binary_default), params, request_id, placements,
                        classes, input_regions)


def _tensor_fields(tensor) -> tuple[str, datatypes.DataType, tuple[int, ...], dict]:
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise InvalidInputError("every input must be a JSON object with a string 'name'")
    name = tensor["name"]
    dtype = datatypes.BY_API.get(tensor.get("datatype")) if isinstance(tensor.get("datatype"), str) else None
    if dtype is None:
        raise InvalidInputError(f"input {shown(name)} has unknown datatype {capped(repr(tensor.get('datatype')), 40)}; "
                                f"use one of {sorted(datatypes.BY_API)}")
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise InvalidInputError(f"input {shown(name)}: 'shape' must be a list of integers, got {capped(repr(shape), 100)}")
    params = tensor.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInputError(f"input {shown(name)}: 'parameters' must be a JSON object")
    return name, dtype, tensors.checked_shape(name, tuple(shape)), params


def _from_json(name: str, dtype: datatypes.DataType, shape: tuple[int, ...], data) -> np.ndarray:
    count = math.prod(shape)
    _check_depth(name, data)
    if dtype.api == "BYTES":
        flat = np.array(data, dtype=object).reshape(-1) if isinstance(data, list) else None
        if flat is None or flat.size != count or not all(isinstance(v, str) for v in flat):
            raise InvalidInputError(f"input {shown(name)}: BYTES data must be a list of {count} strings for shape {list(shape)}")
        out = np.empty(count, dtype=object)
        out[:] = [v.encode() for v in flat]  # per element: each is its own Python object anyway
        return out.reshape(shape)
    try:
        parsed = np.asarray(data)
    except (ValueError, TypeError):  # ragged nesting
        raise InvalidInputError(f"input {shown(name)}: 'data' is not a regular (non-ragged) list of numbers") from None
    kind = "f" if dtype.api == "BF16" else dtype.numpy.kind  # bfloat16 is numpy's void kind "V", a float all the same
    if parsed.size != count:
        raise InvalidInputError(f"input {shown(name)}: 'data' has {parsed.size} elements but shape {list(shape)} needs {count}")
    if count and parsed.dtype.kind not in _ACCEPTED_KINDS.get(kind, ""):
        raise InvalidInputError(f"input {shown(name)}: 'data' holds {_kind_name(parsed.dtype.kind)} values, "
                                f"which are not {dtype.api}")
    if count and kind in "iu":
        info = np.iinfo(dtype.numpy)
        if parsed.min() < info.min or parsed.max() > info.max:
            raise InvalidInputError(f"input {shown(name)}: values outside the {dtype.api} range [{info.min}, {info.max}]")
    return parsed.astype(dtype.numpy, copy=False).reshape(shape)


def _check_depth(name: str, data) -> None:
    """Triton's limit on JSON nesting, along the first elements (a regular list nests as deep everywhere)."""
    depth = 0
    while isinstance(data, list) and data:
        depth, data = depth + 1, data[0]
        if depth > MAX_JSON_DEPTH:
            raise InvalidInputError(f"input {shown(name)}: JSON nesting depth exceeds maximum allowed limit "
                                    f"({MAX_JSON_DEPTH})")


def _kind_name(kind: str) -> str:
    return {"b": "boolean", "i": "integer", "u": "integer", "f": "floating-point", "U": "string"}.get(kind, "mixed or non-numeric")


def _parameters(params) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidInputError("'parameters' must be a JSON object")
    for key, value in params.items():
        if key.startswith("triton_"):  # all of them over HTTP: the one gRPC takes belongs to its streams
            raise InvalidInputError(f"parameter {shown(key)}: parameter keys starting with 'triton_' are reserved for Triton "
                                    "usage and should not be specified.")
        if not isinstance(value, (bool, int, float, str)):
            raise InvalidInputError(f"parameter {shown(key)} must be a boolean, number or string")
    return dict(params)


def _outputs(given) -> tuple[tuple[str, ...], dict[str, bool], list[Placement], tuple[tuple[str, dict], ...]]:
    if given is None:
        return (), {}, [], ()
    if not isinstance(given, list):
        raise InvalidInputError("'outputs' must be a list of {\"name\": ...} objects")
    names, binary, placements, classes = [], {}, [], []
    for out in given:
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise InvalidInputError("every requested output must be a JSON object with a string 'name'")
        params = out.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInputError(f"output {shown(out['name'])}: 'parameters' must be a JSON object")
        if "classification" in params:  # its value is checked with the model's outputs (doors.shared.class_counts)
            classes.append((out["name"], {"classification": params["classification"]}))
        where = placement(out["name"], params)
        if where is not None:
            placements.append(where)
        names.append(out["name"])
        if "binary_data" in params:
            binary[out["name"]] = bool(params["binary_data"])
    return tuple(names), binary, placements, tuple(classes)


def encode_infer(decoded: DecodedInfer, model: str, version: int, outputs: dict[str, np.ndarray],
                 order: tuple[str, ...], shared: dict | None = None) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary data follows it (None: all JSON).

    `shared`: output name -> (Region, Placement), from `SharedMemoryRegistry.targets`: written there and
    answered with the region's parameters and no data, as Triton does."""
    described, chunks = [], []
    for name in order:
        array = outputs[name]
        entry = {"name": name, "datatype": datatypes.from_numpy(array.dtype).api, "shape": list(array.shape)}
        if shared and name in shared:
            entry["parameters"] = write_output(shared[name], array)
        elif decoded.binary_outputs.get(name, decoded.binary_default):
            raw = tensors.to_raw(array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = _json_data(name, array)
        described.append(entry)
    head = {"model_name": model, "model_version": str(version), "outputs": described}
    if decoded.id:
        head["id"] = decoded.id
    if parameters_of(outputs):  # the model's response parameters (Triton's Python API)
        head["parameters"] = parameters_of(outputs)
    header = json.dumps(head, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def _json_data(name: str, array: np.ndarray) -> list:
    flat = array.reshape(-1)
    if array.dtype.kind not in "OSU":
        return flat.tolist()
    try:
        return [v.decode() if isinstance(v, bytes) else str(v) for v in flat]
    except UnicodeDecodeError:
        raise InvalidInputError(f"output {shown(name)} holds bytes that are not UTF-8 text; ask for it with "
                                "parameters.binary_data=true") from None


def _shared(regions: SharedMemoryRegistry | None) -> SharedMemoryRegistry:
    if regions is None:  # a caller without regions (the offline path) cannot serve shared memory tensors
        raise InvalidInputError("this entrance does not serve shared memory tensors; send the data in the request")
    return regions

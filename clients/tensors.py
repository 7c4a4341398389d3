"""numpy arrays <-> KServe v2 tensors, always as raw contents (no per-element protobuf work).

The table mirrors the server's, repeated here so the client installs without the server. Raw
contents are little-endian; BYTES elements each carry a 4-byte little-endian length prefix.
"""

from __future__ import annotations

import struct

import numpy as np

BY_API = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
_BY_KIND_SIZE = {(d.kind, d.itemsize): api for api, d in BY_API.items() if api != "BYTES"}
# Typed fields, read only when a server answers without raw contents (Ferry never does; others may).
_TYPED_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
_LENGTH = struct.Struct("<I")


def datatype_of(array: np.ndarray) -> str:
    """The wire datatype for an array: str, bytes and object arrays travel as BYTES."""
    if array.dtype.kind in "USO":
        return "BYTES"
    api = _BY_KIND_SIZE.get((array.dtype.kind, array.dtype.itemsize))
    if api is None:
        raise TypeError(f"numpy dtype {array.dtype} has no KServe v2 datatype")
    return api


def to_raw(array: np.ndarray) -> tuple[str, bytes]:
    """(datatype, raw bytes) for one input."""
    api = datatype_of(array)
    if api == "BYTES":
        return api, b"".join(_LENGTH.pack(len(b)) + b for b in map(_as_bytes, array.reshape(-1)))
    little = array.astype(BY_API[api].newbyteorder("<"), copy=False)
    return api, np.ascontiguousarray(little).tobytes()


def from_raw(datatype: str, shape: tuple[int, ...], data: bytes) -> np.ndarray:
    if datatype == "BYTES":
        items, offset = [], 0
        while offset < len(data):
            (n,) = _LENGTH.unpack_from(data, offset)
            items.append(bytes(data[offset + 4:offset + 4 + n]))
            offset += 4 + n
        return np.array(items, dtype=object).reshape(shape)
    return np.frombuffer(data, dtype=_wire_dtype(datatype)).reshape(shape)


def from_typed(tensor) -> np.ndarray:
    """An output sent in `contents` (InferOutputTensor) as a numpy array."""
    field = _TYPED_FIELD.get(tensor.datatype)
    if field is None:
        raise ValueError(f"output '{tensor.name}' ({tensor.datatype}) has neither raw nor typed contents")
    values = list(getattr(tensor.contents, field))
    dtype = BY_API[tensor.datatype]
    return np.array(values, dtype=dtype).reshape(tuple(tensor.shape))


def _wire_dtype(datatype: str) -> np.dtype:
    if datatype not in BY_API:
        raise ValueError(f"unknown datatype {datatype!r}")
    return BY_API[datatype].newbyteorder("<")


def _as_bytes(item) -> bytes:
    if isinstance(item, bytes):
        return item
    return (item if isinstance(item, str) else str(item)).encode()

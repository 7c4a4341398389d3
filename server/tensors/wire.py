"""KServe v2 raw tensor bytes <-> numpy, for every front door (gRPC raw contents, HTTP binary data).

Raw contents become numpy views over the received bytes (no copy, no per-element Python work). BYTES
is the one exception: each element is its own Python object, so it is parsed element by element.
Shapes are checked per dimension before anything is allocated; every error names the tensor, what
came and what was expected.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from server.tensors import datatypes
from server.errors import InvalidInputError
from server.names import capped, shown

_LENGTH = struct.Struct("<I")
# Shape bounds, as Triton's int32 limits: no accepted tensor is larger than a gRPC message can carry.
MAX_DIM = MAX_ELEMENTS = 2**31 - 1
MAX_RANK = 32


def checked_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Per dimension, never per element: each dim in [0, MAX_DIM], at most MAX_RANK of them, and the
    product of the non-zero dims <= MAX_ELEMENTS, so a zero-size shape like [0, 2**62] is refused
    here rather than by numpy (whose ValueError would surface as INTERNAL)."""
    if len(shape) > MAX_RANK:
        raise InvalidInputError(f"input {shown(name)} has {len(shape)} dimensions; at most {MAX_RANK} are supported")
    if shape and not (0 <= min(shape) and max(shape) <= MAX_DIM):  # the common case passes in two C calls
        for d in shape:
            if not 0 <= d <= MAX_DIM:
                raise InvalidInputError(
                    f"input {shown(name)} has dimension {d} in shape {_shape(shape)}; each must be within [0, {MAX_DIM}]")
    count = math.prod(shape)
    if count > MAX_ELEMENTS or (count == 0 and math.prod(d for d in shape if d) > MAX_ELEMENTS):
        raise InvalidInputError(
            f"input {shown(name)}: shape {_shape(shape)} has more than {MAX_ELEMENTS} elements (2**31 - 1)")
    return shape


def _shape(shape: tuple) -> str:
    return capped(str(list(shape)), 200)


def from_raw(name: str, dtype: datatypes.DataType, shape: tuple, data: bytes) -> np.ndarray:
    count = math.prod(shape)
    if dtype.api == "BYTES":
        return parse_bytes(name, data, count).reshape(shape)
    if len(data) != count * dtype.itemsize:
        raise ByteSizeError(name, count * dtype.itemsize, len(data), f"{list(shape)} of {dtype.api}")
    return np.frombuffer(data, dtype=dtype.numpy).reshape(shape)


class ByteSizeError(InvalidInputError):
    """A tensor's bytes do not fill its shape; in Triton's words, which name the model where a door knows it."""

    def __init__(self, name: str, expected: int, got: int, shape: str, model: str = ""):
        self.name, self.expected, self.got, self.shape = name, expected, got, shape
        where = f" for model '{model}'" if model else ""
        super().__init__(f"input byte size mismatch for input {shown(name)}{where}. Expected {expected}, got {got}: "
                         f"raw content is {got} bytes but shape {shape} needs {expected} bytes")

    def for_model(self, model: str) -> ByteSizeError:
        return ByteSizeError(self.name, self.expected, self.got, self.shape, model)


def parse_bytes(name: str, data: bytes, count: int) -> np.ndarray:
    if count * 4 > len(data):  # every element carries a 4-byte length: refuse before allocating
        raise InvalidInputError(f"input {shown(name)}: {len(data)} bytes cannot hold {count} BYTES elements")
    out = np.empty(count, dtype=object)
    view, offset, end = memoryview(data), 0, len(data)
    for i in range(count):
        if offset + 4 > end:
            raise InvalidInputError(f"input {shown(name)}: BYTES content ends after {i} of {count} elements")
        (length,) = _LENGTH.unpack_from(data, offset)
        offset += 4
        if offset + length > end:
            raise InvalidInputError(f"input {shown(name)}: BYTES element {i} claims {length} bytes past the end of the content")
        out[i] = bytes(view[offset : offset + length])
        offset += length
    if offset != end:
        raise InvalidInputError(f"input {shown(name)}: {end - offset} bytes left over after {count} BYTES elements")
    return out


def to_raw(array: np.ndarray) -> bytes:
    """Flatten a tensor into KServe raw bytes (little-endian, row-major)."""
    if array.dtype.kind in "OSU":
        items = [v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1)]
        return b"".join(_LENGTH.pack(len(v)) + v for v in items)
    return array.tobytes()  # C order whatever the array's own layout (a row of a batch's output is a view)



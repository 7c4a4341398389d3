"""One table for tensor element types: KServe API string, config enum name, numpy dtype.

BYTES travels as numpy object arrays of Python `bytes`; everything else as fixed-size numpy dtypes.
BF16 has no numpy type of its own: ml_dtypes' bfloat16 (numpy's extension dtype, as tritonclient uses)
keeps it two bytes an element on every path, so raw bytes map to arrays without a copy.
"""

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True, slots=True)
class DataType:
    api: str  # "FP32", as on the wire
    config: str  # "TYPE_FP32", as in model_config.proto
    numpy: np.dtype
    itemsize: int  # 0 for BYTES (variable length)


_TABLE = [
    DataType("BOOL", "TYPE_BOOL", np.dtype(np.bool_), 1),
    DataType("UINT8", "TYPE_UINT8", np.dtype(np.uint8), 1),
    DataType("UINT16", "TYPE_UINT16", np.dtype(np.uint16), 2),
    DataType("UINT32", "TYPE_UINT32", np.dtype(np.uint32), 4),
    DataType("UINT64", "TYPE_UINT64", np.dtype(np.uint64), 8),
    DataType("INT8", "TYPE_INT8", np.dtype(np.int8), 1),
    DataType("INT16", "TYPE_INT16", np.dtype(np.int16), 2),
    DataType("INT32", "TYPE_INT32", np.dtype(np.int32), 4),
    DataType("INT64", "TYPE_INT64", np.dtype(np.int64), 8),
    DataType("FP16", "TYPE_FP16", np.dtype(np.float16), 2),
    DataType("BF16", "TYPE_BF16", np.dtype(ml_dtypes.bfloat16), 2),
    DataType("FP32", "TYPE_FP32", np.dtype(np.float32), 4),
    DataType("FP64", "TYPE_FP64", np.dtype(np.float64), 8),
    DataType("BYTES", "TYPE_STRING", np.dtype(object), 0),
]

BY_API = {t.api: t for t in _TABLE}
BY_CONFIG = {t.config: t for t in _TABLE}
# Little-endian on the wire; numpy's native order here is little-endian too, so views need no swap.
_BY_NUMPY = {t.numpy: t for t in _TABLE}


def from_numpy(dtype: np.dtype) -> DataType:
    """The wire type for a numpy dtype; unicode strings count as BYTES (encoded as UTF-8)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "USO":
        return BY_API["BYTES"]
    found = _BY_NUMPY.get(dtype.newbyteorder("=") if dtype.byteorder == "<" else dtype)
    if found is None:
        raise TypeError(f"numpy dtype {dtype} has no KServe datatype")
    return found

"""Triton's raw binary request: `Inference-Header-Content-Length: 0` and no JSON header at all.

The whole body is the one input's bytes, for a model with exactly one input whose shape the byte count
settles: at most one variable dimension (sized from the byte count) or, for BYTES, the shape [1] (the
body is that one element). A batching model gets a batch of one. Every output comes back in binary, as
Triton answers such a request. The rules and error words follow Triton's binary data extension.
"""

from __future__ import annotations

import math

import numpy as np

from server.doors.http.tensors import DecodedInfer
from server.errors import InvalidInputError
from server.tensors import wire
from server.tensors.signature import Signature


def is_raw(header_length: str | None) -> bool:
    return header_length is not None and header_length.strip() == "0"


def decode_raw(signature: Signature, body: bytes) -> DecodedInfer:
    """The request a raw body makes: its one input shaped from the byte count, every output binary."""
    if len(signature.inputs) != 1:
        raise InvalidInputError(f"Raw request must only have 1 input (found 1) to be deduced but got "
                                f"{len(signature.inputs)} inputs in '{signature.model}' model configuration")
    spec = next(iter(signature.inputs.values()))
    shape = list(spec.dims)
    variable = [i for i, d in enumerate(shape) if d == -1]
    if len(variable) > 1:
        raise InvalidInputError(f"The shape of the raw input '{spec.name}' can not be deduced because there are "
                                "more than one variable-sized dimension")
    batch = [1] if signature.batching else []
    if spec.datatype.api == "BYTES":
        if variable or math.prod(shape) != 1:
            raise InvalidInputError(f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]")
        value = np.empty(1, dtype=object)
        value[0] = bytes(body)
        return _decoded(spec.name, value.reshape(batch + shape))
    fixed = math.prod(d for d in shape if d != -1) * spec.datatype.itemsize
    if variable:
        if fixed == 0 or len(body) % fixed:
            raise InvalidInputError(f"raw input '{spec.name}': {len(body)} bytes are not a whole number of "
                                    f"{spec.datatype.api} elements of shape {shape} (-1 sized from the body)")
        shape[variable[0]] = len(body) // fixed
    return _decoded(spec.name, wire.from_raw(spec.name, spec.datatype, tuple(batch + shape), body))


def _decoded(name: str, value: np.ndarray) -> DecodedInfer:
    return DecodedInfer(inputs={name: value}, requested=(), binary_outputs={}, binary_default=True)

"""Triton's generate extension for models that are not generation models (a decoupled Python model, say).

As in Triton, each top-level JSON key names an input tensor (a number, string or nested list, shaped
by the config's dims; a batching model's request is one row), `parameters` are the request's
parameters, and each response is a JSON object of the model's outputs (a one-element output as a
plain value). /generate answers once; /generate_stream sends every response of a decoupled model as
a server-sent event. Checking is the same as for an infer call (frontdoor.infer_request).
"""

from __future__ import annotations

import math
import time
from typing import AsyncIterator

import numpy as np

from server.errors import InvalidInputError
from server.doors.shared import infer_request
from server.names import shown
from server.runners.base import DECOUPLED


def request(mv, body: dict):
    """The InferRequest a generate body stands for, checked against the model's signature."""
    arrival = time.monotonic_ns()
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInputError("'parameters' must be a JSON object")
    unknown = set(body) - set(mv.signature.inputs) - {"parameters", "id"}
    if "text_input" in unknown:  # a prompt for a model that takes none
        raise InvalidInputError(f"model '{mv.name}' is not a generation model (its backend is {mv.config.backend!r}); "
                                f"send its inputs by name: {sorted(mv.signature.inputs)}")
    if unknown:
        raise InvalidInputError(f"model '{mv.name}' has no inputs {shown(str(sorted(unknown)))}; "
                                f"its inputs: {sorted(mv.signature.inputs)}")
    inputs = {name: _tensor(mv, name, value) for name, value in body.items() if name in mv.signature.inputs}
    return infer_request(mv, inputs, (), params, str(body.get("id", "")), arrival, None)


def _tensor(mv, name: str, value) -> np.ndarray:
    spec = mv.signature.inputs[name]
    if spec.datatype.api == "BYTES":
        array = np.vectorize(lambda v: v.encode() if isinstance(v, str) else bytes(v), otypes=[object])(
            np.asarray(value, dtype=object))
    else:
        try:
            array = np.asarray(value, dtype=spec.datatype.numpy)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"input '{name}': {exc}") from None
    dims = list(spec.dims)
    if array.ndim != len(dims) and dims.count(-1) <= 1:  # a flat list or a scalar, shaped by the config
        known = math.prod(d for d in dims if d != -1)
        dims = [array.size // max(known, 1) if d == -1 else d for d in dims]
        if math.prod(dims) == array.size:
            array = array.reshape(dims)
    return array[np.newaxis] if (mv.signature.max_batch_size > 0) else array


def answer(mv, outputs: dict[str, np.ndarray]) -> dict:
    out = {"model_name": mv.name, "model_version": str(mv.version)}
    for name, array in outputs.items():
        array = array[0] if (mv.signature.max_batch_size > 0) and array.ndim and array.shape[0] == 1 else array
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
        out[name] = values[0] if len(values) == 1 else values
    return out


async def responses(mv, body: dict) -> AsyncIterator[dict]:
    """Every response, as the model makes it (one for a model that answers once)."""
    infer = request(mv, body)
    if mv.runner.serves == DECOUPLED:
        async for outputs in mv.runner.stream(infer):
            yield answer(mv, outputs)
    else:
        yield answer(mv, await mv.runner.infer(infer))

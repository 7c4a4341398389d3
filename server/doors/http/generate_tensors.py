"""Triton's generate extension for models that are not generation models (a decoupled Python model, say).

As in Triton, each top-level JSON key that names an input is that input (a value or a flat list, shaped
by the input's dims: the innermost variable dimension takes what the fixed ones leave, any other is 1;
a batching model's request is one row), `parameters` is an object read the same way, every other key is
a request parameter (a string, number or boolean), and `id` is echoed. Keys are read in document order
and a repeated input is refused, with Triton's words, as are values of the wrong JSON type. /generate
answers with the model's one response; /generate_stream sends every response of a decoupled model as
a server-sent event. Checking is otherwise the same as for an infer call (doors.shared.infer_request).
"""

from __future__ import annotations

import math
import time
from typing import Any, AsyncIterator

import numpy as np

from server.doors.http.body import BodyTooLargeError
from server.doors.http.tensors import parse_json
from server.doors.shared import infer_request
from server.errors import InvalidInputError
from server.runners.base import DECOUPLED

# The JSON kinds (numpy's, after np.asarray) an input of each numpy kind takes, and Triton's words otherwise.
_TAKES = {"b": ("b", "non-boolean as boolean"), "i": ("iu", "non-signed-integer as signed-integer"),
          "u": ("iu", "non-unsigned-integer as unsigned-integer"), "f": ("iuf", "non-number as number"),
          "O": ("U", "non-string as string")}


class JsonObject(dict):
    """A JSON object that keeps its members in document order, repeated keys included (`pairs`)."""

    def __init__(self, pairs: list[tuple[str, Any]]):
        super().__init__(pairs)
        self.pairs = pairs


def parse_body(data: bytes) -> JsonObject:
    body = parse_json(data, object_pairs_hook=JsonObject)
    if not isinstance(body, JsonObject):
        raise InvalidInputError("the generate request must be a JSON object of input names and values")
    return body


class _Request:
    """What a generate body's members make: inputs, parameters and the id."""

    def __init__(self, mv, limit: int | None):
        self.mv, self.inputs, self.parameters, self.id = mv, {}, {}, ""
        self.limit, self.size = limit, 0

    def read(self, pairs: list[tuple[str, Any]], top: bool = True) -> None:
        for key, value in pairs:
            if top and key == "parameters" and key not in self.mv.signature.inputs:
                self._nested(key, value)
            elif key in self.mv.signature.inputs:
                if key in self.inputs:
                    raise InvalidInputError(f"input '{key}' already exists in request")
                self.inputs[key] = _tensor(self.mv, key, value)
                self._count(key, self.inputs[key])
            elif top and key == "id":
                if not isinstance(value, str):
                    raise InvalidInputError("'id' must be a string")
                self.id = value
            else:
                if isinstance(value, (dict, list)) or value is None:
                    raise InvalidInputError(f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'.")
                self.parameters[key] = value

    def _count(self, name: str, array: np.ndarray) -> None:
        """The tensors JSON values make are held to the HTTP input limit, as Triton holds them."""
        self.size += array.nbytes
        if self.limit is not None and self.size > self.limit:
            raise BodyTooLargeError(f"request size of {self.size} bytes with input '{name}' exceeds the maximum allowed "
                                    f"input size of {self.limit} bytes (--http-max-input-size)")

    def _nested(self, key: str, value) -> None:
        if not isinstance(value, dict):
            raise InvalidInputError(f"Expected JSON object for keyword: '{key}'")
        try:
            self.read(getattr(value, "pairs", list(value.items())), top=False)
        except InvalidInputError as exc:
            raise InvalidInputError(f"Converting keyword: '{key}': {exc.message}") from None


def request(mv, body: dict, limit: int | None = None):
    """The InferRequest a generate body stands for, checked against the model's signature; `limit`: the
    most bytes its tensors may take."""
    arrival = time.monotonic_ns()
    read = _Request(mv, limit)
    read.read(getattr(body, "pairs", list(body.items())))
    try:
        return infer_request(mv, read.inputs, (), read.parameters, read.id, arrival, None)
    except InvalidInputError as exc:
        if "text_input" not in read.parameters:
            raise
        raise InvalidInputError(f"{exc.message}; model '{mv.name}' is not a generation model (its backend is "
                                f"{mv.config.backend!r}): send its inputs by name, not 'text_input'") from None


def _tensor(mv, name: str, value) -> np.ndarray:
    spec = mv.signature.inputs[name]
    try:
        parsed = np.asarray(value)
    except ValueError:  # ragged nesting
        raise InvalidInputError(f"input '{name}': the value is not a regular (non-ragged) list") from None
    kind = spec.datatype.numpy.kind
    takes, words = _TAKES.get(kind, ("", f"non-{spec.datatype.api} as {spec.datatype.api}"))
    if parsed.size and parsed.dtype.kind not in takes:
        raise InvalidInputError(f"attempt to access JSON {words} (input '{name}')")
    if kind == "O":
        array = np.empty(parsed.size, dtype=object)
        array[:] = [v.encode() for v in parsed.reshape(-1).tolist()]
    else:
        if kind in "iu" and parsed.size:
            info = np.iinfo(spec.datatype.numpy)
            if parsed.min() < info.min or parsed.max() > info.max:
                raise InvalidInputError(f"input '{name}': values outside the {spec.datatype.api} range [{info.min}, {info.max}]")
        array = parsed.astype(spec.datatype.numpy).reshape(-1)
    full = ([-1] if mv.signature.batching else []) + list(spec.dims)
    if parsed.ndim == len(full) and all(d in (-1, s) for d, s in zip(full, parsed.shape)):
        return array.reshape(parsed.shape)  # already shaped as the model takes it
    return array.reshape(_shape(name, full, parsed.size))


def _shape(name: str, dims: list[int], count: int) -> list[int]:
    """Triton's shaping of a flat value: fixed dims take their share, the innermost -1 the rest, other -1s 1."""
    fixed = math.prod(d for d in dims if d != -1)
    variable = [i for i, d in enumerate(dims) if d == -1]
    if (count != fixed) if not variable else ((count % fixed) if fixed else count):
        raise InvalidInputError(f"The schema can not convert input '{name}' to tensor with proper shape")
    shape = [1 if d == -1 else d for d in dims]
    if variable:
        shape[variable[-1]] = count // fixed if fixed else 0
    return shape


def answer(mv, outputs: dict[str, np.ndarray], request_id: str = "") -> dict:
    out = {"id": request_id} if request_id else {}
    out.update(model_name=mv.name, model_version=str(mv.version))
    for name, array in outputs.items():
        array = array[0] if mv.signature.batching and array.ndim and array.shape[0] == 1 else array
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
        out[name] = values[0] if len(values) == 1 else values
    return out


async def responses(mv, infer) -> AsyncIterator[dict]:
    """Every response to a checked request (see `request`), as the model makes it (one for a model that answers once)."""
    if mv.runner.serves == DECOUPLED:
        async for outputs in mv.runner.stream(infer):
            yield answer(mv, outputs, infer.id)
    else:
        yield answer(mv, await mv.runner.infer(infer), infer.id)


def one_answer(answers: list[dict]) -> dict:
    """/generate's answer: the model's one response."""
    if len(answers) != 1:
        raise InvalidInputError(f"generate expects model to produce exactly 1 response, got {len(answers)}; "
                                "use generate_stream for a model that makes any number of responses")
    return answers[0]

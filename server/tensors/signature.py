"""A model's tensor signature, and the checks every request passes before it is queued.

Checks run once per request on shapes and dtypes only (never per element), and every message names
the tensor and what was expected, so a client can fix the call without reading server logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from protos import model_config_pb2 as mc
from server.tensors import datatypes
from server.errors import InvalidInputError
from server.names import shown
from server.tensors.padding import Padding
from server.tensors.reshape import Reshape


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: datatypes.DataType
    dims: tuple[int, ...]  # without the batch dimension; -1 = any size
    optional: bool = False
    text: bool = False  # BYTES the model reads as text: every element must be UTF-8

    def shape_for_metadata(self, batching: bool) -> list[int]:
        return ([-1] if batching else []) + list(self.dims)


@dataclass(frozen=True, slots=True)
class Signature:
    model: str
    max_batch_size: int
    inputs: dict[str, TensorSpec]  # what clients send (inputs the server fills are left out)
    outputs: dict[str, TensorSpec]
    padding: Padding | None = None  # variable-length inputs: requests of different lengths join
    reshape: Reshape | None = None  # tensors the model file shapes differently from the config's dims
    labels: dict[str, tuple[str, ...]] = field(default_factory=dict)  # output -> class labels (classification)
    _plain: bool = field(default=False, init=False, repr=False, compare=False)  # check_inputs' one-pass check applies

    def __post_init__(self) -> None:
        plain = self.padding is None and not any(s.optional or s.text for s in self.inputs.values())
        object.__setattr__(self, "_plain", plain)

    @classmethod
    def from_config(cls, config: mc.ModelConfig, text_bytes: bool = False) -> Signature:
        """`text_bytes`: the backend reads BYTES inputs as text (see Backend.bytes_as_text)."""
        def spec(t) -> TensorSpec:
            dtype = datatypes.BY_CONFIG[mc.DataType.Name(t.data_type)]
            text = text_bytes and dtype.api == "BYTES"
            return TensorSpec(t.name, dtype, tuple(t.dims), getattr(t, "optional", False), text)

        padding = Padding.from_config(config)
        filled = padding.filled if padding else frozenset()
        return cls(
            model=config.name,
            max_batch_size=config.max_batch_size,
            inputs={t.name: spec(t) for t in config.input if t.name not in filled},
            outputs={t.name: spec(t) for t in config.output},
            padding=padding,
            reshape=Reshape.from_config(config),
        )

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 0

    def check_inputs(self, inputs: dict[str, np.ndarray]) -> tuple[int, tuple]:
        """Validate decoded inputs; return (batch size, key of shapes that must match to join)."""
        checked = self._plain_inputs(inputs) if self._plain else None
        return checked if checked is not None else self._checked_inputs(inputs)

    def _checked_inputs(self, inputs: dict[str, np.ndarray]) -> tuple[int, tuple]:
        for name in inputs:
            if self.padding and name in self.padding.filled:
                raise InvalidInputError(f"input {shown(name)} of model '{self.model}' is filled in by the server; do not send it")
            if name not in self.inputs:
                raise InvalidInputError(
                    f"unexpected inference input {shown(name)} for model '{self.model}'; expected inputs: {sorted(self.inputs)}"
                )
        missing = [n for n, s in self.inputs.items() if n not in inputs and not s.optional]
        if missing:
            raise InvalidInputError(self._missing_message(inputs, missing))
        batch_sizes = set()
        key = []
        for name, spec in self.inputs.items():
            value = inputs.get(name)
            if value is None:
                key.append((name, None))
                continue
            self._check_dtype(spec, value)
            if spec.text:
                self._check_text(spec, value)
            shape = value.shape
            if self.batching:
                if len(shape) < 1 or shape[0] < 0:  # zero rows is a batch, as in Triton: an empty answer
                    raise InvalidInputError(
                        f"input '{name}' has shape {list(shape)}; model '{self.model}' batches, so dim 0 "
                        f"is the batch size (0..{self.max_batch_size}) followed by dims {list(spec.dims)}"
                    )
                batch_sizes.add(shape[0])
                shape = shape[1:]
            self._check_dims(spec, shape, value.shape)
            key.append((name, self.padding.join_shape(name, shape) if self.padding else shape))
        if len(batch_sizes) > 1:
            raise InvalidInputError(f"inputs of model '{self.model}' disagree on the batch size: {sorted(batch_sizes)}")
        batch_size = batch_sizes.pop() if batch_sizes else 1
        if self.batching and batch_size > self.max_batch_size:
            raise InvalidInputError(
                f"batch size {batch_size} exceeds max_batch_size {self.max_batch_size} of model '{self.model}'"
            )
        return batch_size, tuple(key)

    def _missing_message(self, inputs: dict, missing: list[str]) -> str:
        """Triton's words, which clients and their tests match on."""
        required = sum(not s.optional for s in self.inputs.values())
        total = len(self.inputs)
        expected = f"{total} inputs" if required == total else f"number of inputs between {required} and {total}"
        got = "[" + ",".join(f"'{n}'" for n in inputs) + "]"
        wanted = "[" + ",".join(f"'{n}'" for n in missing) + "]"
        return (f"expected {expected} but got {len(inputs)} inputs for model '{self.model}'. Got input(s) {got}, "
                f"but missing required input(s) {wanted}. Please provide all required input(s).")

    def _plain_inputs(self, inputs: dict[str, np.ndarray]) -> tuple[int, tuple] | None:
        """check_inputs in one pass for the usual request to a model with nothing optional, padded or read as
        text: every input sent in its declared dtype and dims, one batch size within the limit. None for
        anything else, which the full check then accepts or refuses with its own messages."""
        if len(inputs) != len(self.inputs):
            return None
        limit, rows, key = self.max_batch_size, -1, []
        for name, spec in self.inputs.items():
            value = inputs.get(name)
            if value is None or value.dtype != spec.datatype.numpy:
                return None
            shape = value.shape
            if limit > 0:
                if not shape or not 0 <= shape[0] <= limit or (rows >= 0 and shape[0] != rows):
                    return None
                rows, shape = shape[0], shape[1:]
            dims = spec.dims
            if shape != dims and (len(shape) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape))):
                return None
            key.append((name, shape))
        return (rows if rows >= 0 else 1), tuple(key)

    def length(self, inputs: dict[str, np.ndarray]) -> int:
        """A checked request's length along the variable dimension (0 where the model has none)."""
        return self.padding.length(inputs) if self.padding else 0

    def check_outputs(self, requested: tuple[str, ...]) -> None:
        if len(set(requested)) != len(requested):
            twice = next(n for i, n in enumerate(requested) if n in requested[:i])
            raise InvalidInputError(f"output {shown(twice)} already exists in request")
        for name in requested:
            if name not in self.outputs:
                raise InvalidInputError(
                    f"unknown output {shown(name)} requested from model '{self.model}'; outputs: {sorted(self.outputs)}"
                )

    def _check_dtype(self, spec: TensorSpec, value: np.ndarray) -> None:
        if value.dtype == spec.datatype.numpy:  # the usual case, without the table lookup
            return
        got = datatypes.from_numpy(value.dtype)
        if got is not spec.datatype:
            raise InvalidInputError(
                f"input '{spec.name}' has datatype {got.api}; model '{self.model}' expects {spec.datatype.api}"
            )

    def _check_dims(self, spec: TensorSpec, dims: tuple, full_shape: tuple) -> None:
        if dims == spec.dims:  # fixed dims sent as declared: nothing to compare one by one
            return
        if len(dims) != len(spec.dims) or any(d != -1 and d != s for d, s in zip(spec.dims, dims)):
            expected = spec.shape_for_metadata(self.batching)
            raise InvalidInputError(
                f"input '{spec.name}' has shape {list(full_shape)}; model '{self.model}' expects {expected} (-1 = any size)"
            )

    def _check_text(self, spec: TensorSpec, value: np.ndarray) -> None:
        """Every element UTF-8, checked in one C pass: joined with NUL, which can neither complete nor
        start a multi-byte sequence, the whole decodes exactly when each element does."""
        items = value.reshape(-1).tolist()
        try:
            b"\x00".join(items).decode("utf-8")
            return
        except (TypeError, UnicodeDecodeError):  # TypeError: some elements are str (text already)
            pass
        bad = next((i for i, v in enumerate(items) if not _is_utf8(v)), None)
        if bad is None:
            return
        raise InvalidInputError(
            f"input '{spec.name}' element {bad} is not valid UTF-8; model '{self.model}' reads this BYTES input as text"
        )


def _is_utf8(value) -> bool:
    if isinstance(value, str):
        return True
    try:
        bytes(value).decode("utf-8")
        return True
    except (UnicodeDecodeError, TypeError):
        return False

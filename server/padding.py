"""Padded batches: requests of different lengths share one backend call.

A config marks inputs `variable_length`; the first -1 in their dims is the length. A batch is
right-padded to its longest member with the input's `padding_value`, the server fills the inputs
named by `lengths_input` ([rows, 1] true lengths) and `mask_input` ([rows, longest] 1/0), and outputs
marked `variable_length` are sliced back to each request's own length. Copies are one numpy
assignment per request and input; nothing loops over elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos import model_config_pb2 as mc
from server import datatypes
from server.errors import BackendError, ConfigError, InvalidInputError
from server.request import InferRequest, copies_as_bytes, join_rows


@dataclass(frozen=True, slots=True)
class PaddedInput:
    axis: int  # of the length, in the batched tensor (dim 0 is the batch)
    value: float


@dataclass(frozen=True, slots=True)
class PadCount:
    """Positions along the length of one batch: padding added, and all computed (rows x longest)."""

    padded: int = 0
    computed: int = 0


@dataclass(frozen=True, slots=True)
class Padding:
    inputs: dict[str, PaddedInput]
    outputs: dict[str, int]  # output name -> axis of the length in the batched tensor
    lengths: dict[str, np.dtype]  # server-filled inputs: true length per row, [rows, 1]
    masks: dict[str, np.dtype]  # server-filled inputs: 1 at real positions, 0 at padding, [rows, longest]

    @property
    def filled(self) -> frozenset[str]:
        """Inputs the server writes; clients never send them."""
        return frozenset(self.lengths) | frozenset(self.masks)

    @classmethod
    def from_config(cls, config: mc.ModelConfig) -> Padding | None:
        """The model's padding rules, or None when no input is variable-length; refuses inconsistent configs."""
        declared = {t.name: t for t in config.input}
        inputs, lengths, masks = {}, {}, {}
        for i, tensor in enumerate(config.input):
            where = f"model '{config.name}': input[{i}] '{tensor.name}'"
            if not tensor.variable_length:
                if tensor.padding_value or tensor.lengths_input or tensor.mask_input:
                    raise ConfigError(f"{where}: padding_value, lengths_input and mask_input need variable_length: true")
                continue
            if config.max_batch_size <= 0:
                raise ConfigError(f"{where}: variable_length needs max_batch_size > 0 (padding joins requests into batches)")
            if tensor.data_type == mc.TYPE_STRING:
                raise ConfigError(f"{where}: variable_length is not supported for TYPE_STRING inputs")
            inputs[tensor.name] = PaddedInput(1 + _length_axis(tensor, where), tensor.padding_value)
            for name, dims, target in ((tensor.lengths_input, [1], lengths), (tensor.mask_input, [-1], masks)):
                if name:
                    target[name] = _filled_dtype(declared, name, dims, where)
        if not inputs:
            if any(o.variable_length for o in config.output):
                raise ConfigError(f"model '{config.name}': an output is variable_length but no input is")
            return None
        for name in set(lengths) | set(masks):
            if name in inputs:
                raise ConfigError(f"model '{config.name}': input '{name}' is filled by the server and cannot be variable_length")
        outputs = {o.name: 1 + _length_axis(o, f"model '{config.name}': output '{o.name}'")
                   for o in config.output if o.variable_length}
        return cls(inputs, outputs, lengths, masks)

    def length(self, inputs: dict[str, np.ndarray]) -> int:
        """One request's length; its variable-length inputs must agree on it."""
        found = {name: inputs[name].shape[spec.axis] for name, spec in self.inputs.items()
                 if name in inputs and inputs[name].ndim > spec.axis}
        if len(set(found.values())) > 1:
            raise InvalidInputError(f"variable-length inputs must share one length, got {found}")
        return next(iter(found.values()), 0)

    def join_shape(self, name: str, shape: tuple) -> tuple:
        """The part of an input's shape (without dim 0) that must match for requests to join."""
        spec = self.inputs.get(name)
        if spec is None:
            return shape
        return shape[:spec.axis - 1] + (-1,) + shape[spec.axis:]

    def gather(self, requests: list[InferRequest]) -> tuple[dict[str, np.ndarray], PadCount]:
        """The batch's inputs, padded to its longest member, with the lengths and masks filled in."""
        rows = np.array([r.batch_size for r in requests])
        lengths = np.array([r.length for r in requests])
        longest = int(lengths.max())
        first = requests[0]
        joined = {}
        for name in first.inputs:
            arrays = [r.inputs[name] for r in requests]
            spec = self.inputs.get(name)
            if spec is not None and (lengths != longest).any():
                joined[name] = _pad(arrays, spec, longest)
            else:
                joined[name] = arrays[0] if len(arrays) == 1 else join_rows(arrays)
        row_lengths = np.repeat(lengths, rows)  # [total rows]
        for name, dtype in self.lengths.items():
            joined[name] = row_lengths.reshape(-1, 1).astype(dtype)
        for name, dtype in self.masks.items():
            joined[name] = (np.arange(longest) < row_lengths[:, None]).astype(dtype)  # [rows, longest]
        computed = int(rows.sum()) * longest
        return joined, PadCount(computed - int((rows * lengths).sum()), computed)

    def trim(self, requests: list[InferRequest], split: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Slice variable-length outputs back to each request's own length (views, no copies)."""
        if not self.outputs:
            return split
        longest = max(r.length for r in requests)
        for request, outputs in zip(requests, split):
            for name, axis in self.outputs.items():
                value = outputs.get(name)
                if value is None:
                    continue
                if value.ndim <= axis or value.shape[axis] != longest:
                    raise BackendError(
                        f"output '{name}' has shape {list(value.shape)}; as a variable_length output its dim {axis} "
                        f"must be the batch's padded length {longest}"
                    )
                index = [slice(None)] * value.ndim
                index[axis] = slice(0, request.length)
                outputs[name] = value[tuple(index)]
        return split


def _pad(arrays: list[np.ndarray], spec: PaddedInput, longest: int) -> np.ndarray:
    shape = list(arrays[0].shape)
    shape[0] = sum(a.shape[0] for a in arrays)
    shape[spec.axis] = longest
    out = np.full(shape, spec.value, dtype=arrays[0].dtype)
    if spec.axis == 1 and copies_as_bytes(arrays, out.dtype):
        # Each row's real positions are the start of its padded row: plain byte copies that keep the
        # GIL (NumPy lets go of it per copy of a long row; see request.join_rows).
        target, padded_row, row = memoryview(out).cast("B"), out[0].nbytes, 0
        for array in arrays:
            source, real_row = memoryview(array).cast("B"), array[0].nbytes
            for k in range(array.shape[0]):
                target[row * padded_row:row * padded_row + real_row] = source[k * real_row:(k + 1) * real_row]
                row += 1
        return out
    index = [slice(None)] * len(shape)
    start = 0
    for array in arrays:
        index[0] = slice(start, start + array.shape[0])
        index[spec.axis] = slice(0, array.shape[spec.axis])
        out[tuple(index)] = array
        start += array.shape[0]
    return out


def _length_axis(tensor, where: str) -> int:
    if -1 not in tensor.dims:
        raise ConfigError(f"{where}: variable_length needs a -1 in dims (the length), got {list(tensor.dims)}")
    return list(tensor.dims).index(-1)


def _filled_dtype(declared: dict, name: str, dims: list[int], where: str) -> np.dtype:
    tensor = declared.get(name)
    if tensor is None:
        raise ConfigError(f"{where}: names '{name}' to fill, but the config declares no such input")
    if list(tensor.dims) != dims:
        raise ConfigError(f"{where}: input '{name}' is filled by the server and must have dims {dims}, got {list(tensor.dims)}")
    dtype = datatypes.BY_CONFIG[mc.DataType.Name(tensor.data_type)]
    if dtype.api == "BYTES":
        raise ConfigError(f"{where}: input '{name}' is filled with numbers and cannot be TYPE_STRING")
    return np.dtype(dtype.numpy)

"""Padded batches: requests of different lengths share one backend call.

A config marks inputs `variable_length`; the first -1 in their dims is the length. A batch is
right-padded to its longest member with the input's `padding_value`, the server fills the inputs
named by `lengths_input` ([rows, 1] true lengths) and `mask_input` ([rows, longest] 1/0), and outputs
marked `variable_length` are sliced back to each request's own length. This module holds the rules
read from the config; assembly.py applies them to a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos import model_config_pb2 as mc
from server.tensors import datatypes
from server.errors import ConfigError, InvalidInputError


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

"""Triton's `reshape`: a tensor's shape on the wire differs from the shape the model file uses.

Triton's own densenet_onnx config declares its input as dims [3, 224, 224] with reshape [1, 3, 224,
224] and its output as dims [1000] with reshape [1, 1000, 1, 1]: clients send and receive the dims,
the model sees the reshape. Both are views (numpy reshape of contiguous arrays), never copies. With
batching, the batch dimension stays in front and the rest is reshaped row by row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from protos import model_config_pb2 as mc
from server.errors import BackendError, ConfigError


@dataclass(frozen=True, slots=True)
class Reshape:
    to_model: dict[str, tuple[int, ...]]  # input name -> the model's shape (without the batch dim)
    to_client: dict[str, tuple[int, ...]]  # output name -> the config's dims (without the batch dim)
    batching: bool

    @classmethod
    def from_config(cls, config: mc.ModelConfig) -> Reshape | None:
        inputs = {t.name: tuple(t.reshape.shape) for t in config.input if t.HasField("reshape")}
        outputs = {t.name: tuple(t.dims) for t in config.output if t.HasField("reshape")}
        if not inputs and not outputs:
            return None
        return cls(inputs, outputs, config.max_batch_size > 0)

    def inputs(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: self._view(value, self.to_model.get(name)) for name, value in inputs.items()}

    def outputs(self, outputs: dict[str, np.ndarray], model: str) -> dict[str, np.ndarray]:
        try:
            return {name: self._view(value, self.to_client.get(name)) for name, value in outputs.items()}
        except ValueError as exc:
            raise BackendError(f"model '{model}' returned an output its config's reshape does not fit: {exc}") from None

    def _view(self, value: np.ndarray, shape: tuple[int, ...] | None) -> np.ndarray:
        if shape is None:
            return value
        return value.reshape((value.shape[0], *shape) if self.batching else shape)


def validate(kind: str, index: int, tensor, source: str) -> None:
    """Refuse a reshape whose element count cannot match the dims it stands for."""
    where, shape, dims = f"{source}: field '{kind}[{index}].reshape'", list(tensor.reshape.shape), list(tensor.dims)
    if any(d == 0 or d < -1 for d in shape):
        raise ConfigError(f"{where} of {tensor.name!r} must hold -1 or positive sizes, got {shape}")
    if shape.count(-1) > 1 or dims.count(-1) > 1:
        raise ConfigError(f"{where} of {tensor.name!r}: at most one -1 in dims and in reshape (got {dims} and {shape})")
    if -1 not in shape and -1 not in dims and math.prod(shape) != math.prod(dims):
        raise ConfigError(f"{where} of {tensor.name!r}: shape {shape} holds {math.prod(shape)} elements "
                          f"but dims {dims} hold {math.prod(dims)}")
    if (-1 in shape) != (-1 in dims):
        raise ConfigError(f"{where} of {tensor.name!r}: dims {dims} and reshape {shape} must both be fixed or both hold one -1")

"""Triton's `model_warmup`: samples run through every instance while a version loads, before it is ready.

A model's first executions are often its slowest (ONNX Runtime and torch pick kernels and allocate
arenas; CUDA compiles and caches), so the first clients after a load or a hot reload would pay for
them. Each sample (`name`, `batch_size`, `inputs`, `count`) is built from the config: `zero_data`,
`random_data` (seeded, so every load warms with the same values) or `input_data_file` (a file in the
model folder's `warmup/` subfolder holding the tensor's raw bytes, row-major, as a KServe raw input;
BYTES elements each after a 4-byte little-endian length). It goes through the path a real batch
takes (the signature's checks, the assembler that fills lengths and masks and pads, the reshape, the
backend), `count` times (at least once) on each instance. A sample that does not fit the model, or
that the model fails on, fails the load naming the sample, as in Triton. Warmup runs are not counted
in the model's statistics.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from protos import model_config_pb2 as mc
from server.tensors import datatypes
from server.tensors import wire as tensors
from server.tensors.assembly import assembler_for
from server.backends.base import Backend
from server.errors import ConfigError
from server.request import Batch, InferRequest
from server.tensors.signature import Signature

log = logging.getLogger(__name__)
WARMUP_FOLDER = "warmup"


def run(config: mc.ModelConfig, signature: Signature, backends: list[Backend], model_dir: Path, source: str) -> None:
    """Every warmup sample of `config` through every instance; ConfigError naming the sample if one fails."""
    for sample in config.model_warmup:
        where = f"{source}: model_warmup sample '{sample.name}'"
        try:
            batch, inputs = _batch(sample, config, signature, model_dir)
            for backend in backends:
                for _ in range(max(sample.count, 1)):
                    backend.execute(signature.reshape.inputs(inputs) if signature.reshape else inputs)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the model's own failure, reported as the load's reason
            message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            raise ConfigError(f"{where} failed: {message}") from None
        log.info("model '%s': warmed up with sample '%s' (batch %d, %d run(s) on %d instance(s))", config.name,
                 sample.name, batch.size, max(sample.count, 1), len(backends))


def _batch(sample: mc.ModelWarmup, config: mc.ModelConfig, signature: Signature,
           model_dir: Path) -> tuple[Batch, dict[str, np.ndarray]]:
    """The sample as one request's batch, assembled as the runner would assemble it."""
    batching = config.max_batch_size > 0
    rows = sample.batch_size or 1
    if batching and rows > config.max_batch_size:
        raise ConfigError(f"batch_size {rows} is over the model's max_batch_size {config.max_batch_size}")
    if not batching and sample.batch_size > 1:
        raise ConfigError(f"batch_size {sample.batch_size}: the model does not batch (max_batch_size 0)")
    rng = np.random.default_rng(0)
    inputs = {name: _tensor(name, spec, (rows,) * batching, model_dir, rng) for name, spec in sample.inputs.items()}
    try:
        batch_size, key = signature.check_inputs(inputs)
    except Exception as exc:  # noqa: BLE001 - the signature's words name the input and what it expected
        raise ConfigError(getattr(exc, "message", str(exc))) from None
    request = InferRequest(model_name=config.name, inputs=inputs, batch_size=batch_size, batch_key=key,
                           length=signature.length(inputs))
    batch = Batch([request], batched=batching)
    joined, _ = assembler_for(signature).gather(batch)
    return batch, joined


def _tensor(name: str, spec: mc.ModelWarmup.Input, rows: tuple[int, ...], model_dir: Path,
            rng: np.random.Generator) -> np.ndarray:
    dtype = datatypes.BY_CONFIG.get(mc.DataType.Name(spec.data_type))
    if dtype is None:
        raise ConfigError(f"input '{name}': data_type {mc.DataType.Name(spec.data_type)} is not a tensor type")
    if any(d < 0 for d in spec.dims):
        raise ConfigError(f"input '{name}': dims {list(spec.dims)} must be sizes (a sample has no -1)")
    shape = rows + tuple(spec.dims)
    kind = spec.WhichOneof("input_data_type")
    if kind == "input_data_file":
        path = model_dir / WARMUP_FOLDER / spec.input_data_file
        if not path.is_file():
            raise ConfigError(f"input '{name}': no file {model_dir.name}/{WARMUP_FOLDER}/{spec.input_data_file}")
        try:
            return tensors.from_raw(name, dtype, shape, path.read_bytes())
        except Exception as exc:  # noqa: BLE001 - a file of the wrong size, named with what it should hold
            raise ConfigError(getattr(exc, "message", str(exc))) from None
    if kind == "random_data":
        return _random(dtype, shape, rng)
    if dtype.api == "BYTES":
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype.numpy)  # zero_data, and Triton's default when none is chosen


def _random(dtype: datatypes.DataType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if dtype.api == "BYTES":
        return np.array([rng.bytes(8) for _ in range(math.prod(shape))], dtype=object).reshape(shape)
    if dtype.api == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.numpy.kind == "f":
        return rng.random(shape).astype(dtype.numpy)
    return rng.integers(0, 100, shape).astype(dtype.numpy)  # small values: valid ids for most embedding tables

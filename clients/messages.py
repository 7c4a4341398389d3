"""Protobuf requests and plain-Python results, shared by the blocking and the asyncio client."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from clients import tensors
from protos import generate_pb2 as gen_pb
from protos import grpc_service_pb2 as pb

SAMPLING_FIELDS = tuple(f.name for f in gen_pb.SamplingParams.DESCRIPTOR.fields)


@dataclass(frozen=True, slots=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 = any size; a batching model's first dimension is -1


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True, slots=True)
class ModelIndex:
    name: str
    version: str
    state: str  # READY, UNAVAILABLE, ...
    reason: str


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    queue_ms: float
    time_to_first_token_ms: float
    total_ms: float


@dataclass(frozen=True, slots=True)
class GenerateDelta:
    """One streamed message: the new text and token ids; the last one also has the finish reason,
    usage and timings."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str = ""
    usage: Usage | None = None
    timings: Timings | None = None

    @property
    def last(self) -> bool:
        return bool(self.finish_reason)


def server_metadata(response: pb.ServerMetadataResponse) -> ServerMetadata:
    return ServerMetadata(response.name, response.version, tuple(response.extensions))


def model_metadata(response: pb.ModelMetadataResponse) -> ModelMetadata:
    def specs(items):
        return tuple(TensorSpec(t.name, t.datatype, tuple(t.shape)) for t in items)

    return ModelMetadata(response.name, tuple(response.versions), response.platform,
                         specs(response.inputs), specs(response.outputs))


def repository_index(response: pb.RepositoryIndexResponse) -> list[ModelIndex]:
    return [ModelIndex(m.name, m.version, m.state, m.reason) for m in response.models]


def infer_request(model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None,
                  version: str = "", request_id: str = "", parameters: Mapping | None = None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, value in inputs.items():
        array = np.asarray(value)
        datatype, raw = tensors.to_raw(array)
        request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        request.raw_input_contents.append(raw)
    for name in outputs or ():
        request.outputs.add(name=name)
    for key, value in (parameters or {}).items():
        _set_parameter(request.parameters[key], value)
    return request


def infer_outputs(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """Outputs by name; raw contents pair with `outputs` by position."""
    raw = response.raw_output_contents
    result = {}
    for i, tensor in enumerate(response.outputs):
        if raw:
            result[tensor.name] = tensors.from_raw(tensor.datatype, tuple(tensor.shape), raw[i])
        else:
            result[tensor.name] = tensors.from_typed(tensor)
    return result


def generate_request(model: str, prompt: str | Sequence[int], version: str = "", request_id: str = "",
                     priority: int = 0, timeout_us: int = 0, **sampling) -> gen_pb.GenerateRequest:
    """`prompt` is text or token ids; `sampling` takes SamplingParams' fields (max_tokens, temperature, ...)."""
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling option(s) {sorted(unknown)}; use {list(SAMPLING_FIELDS)}")
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    request = gen_pb.GenerateRequest(model_name=model, model_version=version, id=request_id, priority=priority,
                                      timeout_us=timeout_us, sampling=gen_pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(int(t) for t in prompt)
    return request


def generate_delta(response: gen_pb.GenerateResponse) -> GenerateDelta:
    usage = timings = None
    if response.HasField("usage"):
        usage = Usage(response.usage.prompt_tokens, response.usage.completion_tokens)
    if response.HasField("timings"):
        t = response.timings
        timings = Timings(t.queue_ms, t.time_to_first_token_ms, t.total_ms)
    return GenerateDelta(response.text, tuple(response.token_ids), response.finish_reason, usage, timings)


def _set_parameter(target: pb.InferParameter, value) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = str(value)

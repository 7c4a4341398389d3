"""Triton's vLLM backend conventions on ModelStreamInfer: protobuf in and out, nothing else.

What the tensors mean (`text_input`, `stream`, `sampling_parameters`, `exclude_input_in_output`,
`max_tokens` in; `text_output`, `logprobs` out) is read once in runners/generation_tensors.py, which a
Python model's BLS call to a generation model uses too; this module decodes the protobuf request for it
and encodes each answer, with `finish_reason` on the last.
"""

from __future__ import annotations

from protos import grpc_service_pb2 as pb
from server.doors.grpc import codec
from server.runners import generation_tensors
from server.runners.generation_tensors import TensorGeneration, TextAnswer


def read_request(request: pb.ModelInferRequest, arrival_ns: int, rpc_deadline_ns: int | None) -> TensorGeneration:
    return generation_tensors.read(request.model_name, codec.decode_inputs(request),
                                   codec.decode_parameters(request.parameters), arrival_ns, rpc_deadline_ns)


def text_response(request: pb.ModelInferRequest, version: int, answer: TextAnswer) -> pb.ModelInferResponse:
    response = codec.encode_response(request, version, answer.outputs, tuple(answer.outputs))
    if answer.finish_reason:
        response.parameters["finish_reason"].string_param = answer.finish_reason
    return response

"""Triton's vLLM backend conventions on ModelStreamInfer, translated to and from the generation runner.

In: `text_input` (BYTES prompt), optional `stream` (BOOL), `sampling_parameters` (JSON string),
`exclude_input_in_output` (BOOL), `max_tokens` (INT32, wins over the JSON); without the JSON, the
request's own parameters named like sampling parameters are used; either way a value given as a
string ("0.1", "100", "true") is read as its field's type, as that backend does. Out: `text_output` per response,
with `finish_reason` on the last. A request whose sampling parameters ask for `logprobs` also gets a
BYTES output `logprobs`: a JSON list with one object per token of that response, {token id: {"logprob",
"rank", "decoded_token"}} for the sampled token and the top alternatives, the shape Triton's vLLM
backend sends for `return_logprobs` (vLLM's own Logprob objects). Checking what they mean is the runner's decoder's job; this module
only reads tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from protos import grpc_service_pb2 as pb
from server.errors import InvalidInputError
from server.doors.grpc import codec
from server.runners.generation import GenerationInput
from server.runners.sampling import KEYS as SAMPLING_KEYS
from server.runners.sampling import from_strings


@dataclass(frozen=True, slots=True)
class VllmRequest:
    given: GenerationInput
    streaming: bool  # one response per token (True) or one at the end
    exclude_input: bool  # leave the prompt out of the answer's text


def read_request(request: pb.ModelInferRequest, arrival_ns: int, rpc_deadline_ns: int | None) -> VllmRequest:
    inputs = codec.decode_inputs(request)
    text = _scalar(inputs, "text_input")
    if text is None:
        raise InvalidInputError(f"generation model '{request.model_name}' needs a BYTES input 'text_input' with the prompt")
    streaming = bool(_scalar(inputs, "stream", False))
    exclude = _scalar(inputs, "exclude_input_in_output", None)
    exclude = streaming if exclude is None else bool(exclude)  # Triton's vLLM backend: non-streamed answers include the prompt
    if streaming and not exclude:
        raise InvalidInputError("exclude_input_in_output=false cannot be used with stream=true")
    params = codec.decode_parameters(request.parameters)
    given = GenerationInput(
        arrival_ns, text=text if isinstance(text, bytes) else str(text), sampling=_sampling(inputs, params),
        priority=params.get("priority") or 0, timeout_us=params.get("timeout") or 0, rpc_deadline_ns=rpc_deadline_ns)
    return VllmRequest(given, streaming, exclude)


def text_response(request: pb.ModelInferRequest, version: int, text: str, reason: str | None,
                  logprobs: list | None = None) -> pb.ModelInferResponse:
    """`logprobs`: the runner's TokenLogprobs of the tokens this response covers; None when not asked for."""
    outputs = {"text_output": np.array([text.encode()], dtype=object)}
    if logprobs is not None:
        outputs["logprobs"] = np.array([json.dumps([_vllm_logprobs(entry) for entry in logprobs]).encode()], dtype=object)
    response = codec.encode_response(request, version, outputs, tuple(outputs))
    if reason:
        response.parameters["finish_reason"].string_param = reason
    return response


def _vllm_logprobs(entry) -> dict[str, dict]:
    """One token's position as vLLM reports it: the top alternatives by rank, and the sampled token."""
    ranked = {str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": t.token}
              for rank, t in enumerate(entry.top, start=1)}
    sampled = entry.sampled
    ranked.setdefault(str(sampled.token_id), {"logprob": sampled.logprob, "rank": entry.rank, "decoded_token": sampled.token})
    return ranked


def _scalar(inputs: dict[str, np.ndarray], name: str, default=None):
    value = inputs.get(name)
    return default if value is None or value.size == 0 else value.reshape(-1)[0]


def _sampling(inputs: dict[str, np.ndarray], params: dict) -> dict[str, Any]:
    raw = _scalar(inputs, "sampling_parameters")
    if raw is None:
        given = {k: v for k, v in params.items() if k in SAMPLING_KEYS}
    else:
        try:
            given = json.loads(raw)
        except (ValueError, TypeError) as exc:
            raise InvalidInputError(f"sampling_parameters is not valid JSON: {exc}") from None
        if not isinstance(given, dict):
            raise InvalidInputError(f"sampling_parameters must be a JSON object, got {type(given).__name__}")
    given = from_strings(given)  # Triton's vLLM backend reads "0.1" as 0.1 (its own client sends strings)
    if "max_tokens" in inputs:
        given["max_tokens"] = int(_scalar(inputs, "max_tokens", 0))
    return given

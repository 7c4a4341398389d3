"""ferry.generate.v1.Generation: look up -> the runner's decoder -> stream the runner's events -> encode.

A `chat` prompt is rendered by the model's chat template through the HTTP door's own `Templates`, so a
conversation gets the prompt /v1/chat/completions gives it (and `ferry batch --url grpc://` can answer
chat lines over gRPC)."""

from __future__ import annotations

import contextlib
import time

from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from server.repository.registry import Registry
from server.doors.grpc.errors import translate_stream_errors
from server.doors.http.chat import Templates
from server.doors.shared import serving
from server.runners.base import GENERATE
from server.runners.generation import GenerationInput
from server.observability.tracing import doors as trace_doors
from server.observability.tracing.control import TraceControl

SERVICE = gen.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationServicer(gen_grpc.GenerationServicer):
    def __init__(self, registry: Registry, tracing: TraceControl | None = None):
        self.registry = registry
        self.tracing = tracing or TraceControl()
        self.templates = Templates(registry.root)

    @translate_stream_errors
    async def Generate(self, request: gen.GenerateRequest, context):
        arrival = time.monotonic_ns()
        traced = None
        if self.tracing.active:
            trace = self.tracing.begin(request.model_name, request.id, arrival, trace_doors.grpc_carrier(context))
            traced = trace_doors.GenerationTrace(trace, arrival, context) if trace is not None else None
        mv = serving(self.registry, request.model_name, request.model_version, GENERATE)
        remaining = context.time_remaining()
        which = request.WhichOneof("prompt")
        text = request.text if which == "text" else self._chat(mv, request.chat) if which == "chat" else None
        decoded = mv.runner.decode(GenerationInput(
            arrival, text=text,
            token_ids=list(request.token_ids.ids) if which == "token_ids" else None,
            sampling=_sampling(request.sampling), priority=request.priority, timeout_us=request.timeout_us,
            lora_name=request.lora_name,
            rpc_deadline_ns=arrival + int(remaining * 1e9) if remaining is not None else None))
        if traced is not None:
            traced.started(mv.version, request.id, decoded.sampling)
        events = mv.runner.generate(decoded)
        async with contextlib.aclosing(events) as events:  # a client gone closes it now, not at garbage collection
            async for event in events:
                if traced is not None:
                    traced.event(event)
                yield _response(request.id, event, mv.version)

    def _chat(self, mv, chat: gen.ChatPrompt) -> str:
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        return self.templates.prompt(mv, messages, add)


def _response(request_id: str, event, version: int) -> gen.GenerateResponse:
    response = gen.GenerateResponse(id=request_id, token_ids=event.token_ids, text=event.text)
    for entry in event.logprobs or ():
        response.logprobs.append(gen.TokenLogprobs(sampled=_logprob(entry.sampled), top=map(_logprob, entry.top)))
    if event.finish_reason is not None:
        response.finish_reason = event.finish_reason
        response.model_version = str(version)
        response.usage.prompt_tokens = event.prompt_tokens
        response.usage.completion_tokens = event.completion_tokens
        response.timings.queue_ms = event.queue_ms
        response.timings.time_to_first_token_ms = event.ttft_ms
        response.timings.total_ms = event.total_ms
    return response


def _logprob(value) -> gen.Logprob:
    return gen.Logprob(token_id=value.token_id, token=value.token, logprob=value.logprob)


def _sampling(p: gen.SamplingParams) -> dict:
    """The message's fields as the decoder's raw values (unset numbers are 0: the defaults)."""
    given = {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
             "stop": list(p.stop), "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos,
             "min_tokens": p.min_tokens, "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty}
    for optional in ("seed", "repetition_penalty", "logprobs"):  # unset means the default, not 0
        if p.HasField(optional):
            given[optional] = getattr(p, optional)
    structured = {"json": p.json_schema or None, "regex": p.regex or None, "choice": list(p.choice) or None,
                  "grammar": p.grammar or None, "json_object": p.json_object or None}
    if any(v is not None for v in structured.values()):
        given["structured_outputs"] = {k: v for k, v in structured.items() if v is not None}
    return given


def generation_service(servicer: GenerationServicer):
    return servicer, gen_grpc.add_GenerationServicer_to_server, SERVICE

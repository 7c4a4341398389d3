"""/generate, /v1/completions and /v1/chat/completions answered through gRPC Generate (grpc_upstream.py's half
for generation).

The body is read by the same functions the HTTP handlers call (openai_api's, generate.py's) and its
sampling values checked by the runner's own `sampling_params` (a value protobuf cannot carry must be
refused with the decoder's words, not mangled); each choice is one Generate stream, started and
collected by choices.py as the door starts and collects its own; the answer is openai_api.Reply's or
generate.answer's. `Generator` stands in for the runner there: it has the runner's `generate(request)`.
A chat prompt travels as Generate's `chat` prompt and is rendered on the server by the model's
template, as /v1/chat/completions renders it.
"""

from __future__ import annotations

import json

import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from protos import generate_pb2 as gen
from server.errors import InvalidInputError, UnsupportedError
from server.runners.generation import GenerationEvent, GenerationInput, Logprob, TokenLogprobs
from server.runners.sampling import sampling_params
from server.scheduling.sequence import SamplingParams
from server.doors.http import choices
from server.doors.http import generate as generate_api
from server.doors.http import openai_api, streaming
from server.doors.http.chat import checked_messages
from server.doors.http.tensors import parse_json

_UINT32 = 2**32
_UNBOUNDED = 2**62  # stands in for the model's default max_tokens while checking: the server applies its own
_NARROW = ("max_tokens", "top_k", "min_tokens", "logprobs")  # uint32 in SamplingParams


@dataclass(slots=True)
class Answered(GenerationEvent):
    model_version: str = ""  # on the last event: the version that answered (the HTTP answer names it)


@dataclass(frozen=True, slots=True)
class Call:
    """One Generate call to make: what the runner's GenerationRequest is to `generate` (choices.variants copies it)."""

    message: gen.GenerateRequest  # model and prompt; sampling is filled from `sampling` when sent
    sampling: SamplingParams  # checked; a choice's own seed
    max_tokens: int  # as given (0: the model's default, which only the server knows)
    prompt_text: str


class Generator:
    def __init__(self, stub, failure, call_options):
        self.stub, self.failure, self.call_options = stub, failure, call_options

    async def generate(self, call: Call) -> AsyncIterator[GenerationEvent]:
        message = gen.GenerateRequest()
        message.CopyFrom(call.message)
        _fill(message.sampling, call.sampling, call.max_tokens)
        stream = self.stub.Generate(message, **self.call_options())
        try:
            async for response in stream:
                yield _event(response)
        except grpc.aio.AioRpcError as err:
            raise self.failure(err) from None
        finally:
            stream.cancel()  # a choice left early (best_of's losers are not: they run to the end)


async def openai_answer(generator: Generator, raw: bytes, chat: bool) -> dict:
    body = openai_api.checked_body(parse_json(raw))
    wanted = choices.counts(body, completions=not chat)
    model = openai_api.model_of(body)
    message = gen.GenerateRequest(model_name=model)
    if chat and body.get("tools") is not None:
        raise UnsupportedError("tool calling ('tools') needs the HTTP door: gRPC Generate carries no tools")
    if chat:
        logprobs = openai_api.chat_logprobs(body)
        for entry in checked_messages(body.get("messages")):
            message.chat.messages.add(role=entry["role"], content=entry["content"])
        message.chat.add_generation_prompt = bool(body.get("add_generation_prompt", True))
        text, reply = "", openai_api.Reply("chatcmpl", "chat.completion", model, chat=True)
    else:
        text, ids = openai_api.prompt_of(body.get("prompt"))
        logprobs = openai_api.completion_logprobs(body)
        if ids is None:
            message.text = text
        else:
            message.token_ids.ids.extend(ids)
        reply = openai_api.Reply("cmpl", "text_completion", model, chat=False)
    call = _call(message, GenerationInput(time.monotonic_ns(), text=text, sampling=openai_api.sampling_of(body, logprobs)))
    echo = call.prompt_text if body.get("echo") and not chat else ""
    return await openai_api.whole_answer(generator, call, reply, echo, wanted)


async def generate_answer(generator: Generator, model: str, version: str, raw: bytes) -> dict:
    body = parse_json(raw)
    given = generate_api.generation_input(body, time.monotonic_ns())
    message = gen.GenerateRequest(model_name=model, model_version=version, text=given.text)
    call = _call(message, given)
    _check_non_negative(given.priority, "priority")
    _check_non_negative(given.timeout_us, "timeout")
    message.priority, message.timeout_us = given.priority, given.timeout_us
    generation = await streaming.start(generator, call)
    text, last = await generation.collect()
    return generate_api.answer(model, last.model_version, generate_api.whole_text(body, text), last, body.get("id"))


def openai_problem(body: dict, chat: bool) -> str | None:
    messages = body.get("messages") if chat else None
    if chat and body.get("tools") is not None:
        return "tool calling ('tools') needs the HTTP door: gRPC Generate carries no tools (send it with --url http://...)"
    if isinstance(messages, list):
        for i, entry in enumerate(messages):
            extra = sorted(set(entry) - {"role", "content"}) if isinstance(entry, dict) else []
            if extra:
                return (f"messages[{i}] has {', '.join(extra)}: gRPC Generate's chat prompt carries role and "
                        "content only")
    try:
        given = openai_api.sampling_of(body)
    except Exception:  # noqa: BLE001 - a bad body is answered with its 4xx when it runs
        return None
    return _sampling_problem(given)


def generate_problem(body: dict) -> str | None:
    if not isinstance(body.get("text_input"), str):
        return ("a /generate body without a string 'text_input' is for a model that takes tensors by name, which "
                "gRPC Generate does not serve (send it with --url http://...)")
    try:
        given = generate_api.generation_input(body, 0)
    except Exception:  # noqa: BLE001 - a bad body is answered with its 4xx when it runs
        return None
    for name, value in (("priority", given.priority), ("timeout", given.timeout_us)):
        if isinstance(value, int) and not isinstance(value, bool) and value >= (_UINT32 if name == "priority" else 2**64):
            return f"parameter '{name}' {value} does not fit gRPC Generate's field"
    return _sampling_problem(given.sampling)


def _sampling_problem(given: dict) -> str | None:
    for key in _NARROW:
        value = given.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= _UINT32:
            return f"sampling parameter '{key}' {value} does not fit gRPC Generate's 32-bit field"
    seed = given.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and seed < 0:
        return f"a negative seed ({seed}) does not fit gRPC Generate's unsigned field"
    return None


def _call(message: gen.GenerateRequest, given: GenerationInput) -> Call:
    """The decoder's checks on what the message cannot hold; the server decodes again (tokens, lengths)."""
    sampling = sampling_params(given.sampling, _UNBOUNDED)
    max_tokens = given.sampling.get("max_tokens") or 0
    return Call(message, sampling, max_tokens, given.text or "")


def _check_non_negative(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(f"parameter '{name}' must be a non-negative integer, got {value!r}")


def _fill(into: gen.SamplingParams, sampling: SamplingParams, max_tokens: int) -> None:
    into.max_tokens = max_tokens
    into.temperature, into.top_k, into.top_p = sampling.temperature, sampling.top_k, sampling.top_p
    into.stop.extend(sampling.stop)
    into.stop_token_ids.extend(sampling.stop_token_ids)
    into.ignore_eos, into.min_tokens = sampling.ignore_eos, sampling.min_tokens
    into.repetition_penalty = sampling.repetition_penalty
    into.presence_penalty, into.frequency_penalty = sampling.presence_penalty, sampling.frequency_penalty
    if sampling.seed is not None:
        into.seed = sampling.seed
    if sampling.logprobs is not None:
        into.logprobs = sampling.logprobs
    constraint = sampling.constraint
    if constraint is not None:
        if constraint.kind == "choice":
            into.choice.extend(json.loads(constraint.spec))
        else:
            setattr(into, "json_schema" if constraint.kind == "json" else constraint.kind, constraint.spec)


def _event(response: gen.GenerateResponse) -> GenerationEvent:
    logprobs = [TokenLogprobs(_logprob(entry.sampled), 0, [_logprob(t) for t in entry.top]) for entry in response.logprobs]
    event = Answered(list(response.token_ids), response.text, response.finish_reason or None,
                     logprobs=logprobs or None, model_version=response.model_version)
    if event.finish_reason is not None:
        event.prompt_tokens, event.completion_tokens = response.usage.prompt_tokens, response.usage.completion_tokens
    return event


def _logprob(value: gen.Logprob) -> Logprob:
    return Logprob(value.token_id, value.token, value.logprob)

"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions, and /v1/embeddings (embeddings.py).

Requests become the same GenerationInput the gRPC Generate call builds (the runner decodes and checks
it); answers and streamed chunks follow OpenAI's objects, so the `openai` SDK and the tools built on it
work unchanged. vLLM's extra sampling fields (`top_k`, `ignore_eos`, `stop_token_ids`) are accepted
too, and so are `repetition_penalty` and `min_tokens`. `logprobs` (completions: the number of
alternatives; chat: `logprobs: true` with `top_logprobs`) come back in OpenAI's shapes for each
choice and chunk. Chat prompts are rendered with the model's own template (chat.py). `n` choices (and
completions' `best_of`) share the prompt's computation (choices.py); streamed, each chunk names its
choice by `index`; usage counts the prompt once and every generated choice's tokens. A sampled
request is traced once its body names the model (tracing/doors.py's GenerationTrace, as /generate).
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from server.errors import InvalidInputError
from server.repository.registry import Registry
from server.runners.base import GENERATE
from server.runners.generation import GenerationInput
from server.backends.base import parameter
from server.doors.http import choices, embeddings, lora_api, streaming, tools
from server.doors.http.response_format import FIELDS as STRUCTURED_FIELDS, structured_of
from server.doors.http.body import read_body
from server.doors.http.chat import Templates
from server.doors.http.errors import message_of, openai_body, openai_error, status_of
from server.doors.http.tensors import parse_json
from server.observability.tracing import doors as trace_doors
from server.observability.tracing.control import TraceControl

# OpenAI field -> the runner's sampling key (max_completion_tokens is the newer name of max_tokens).
_SAMPLING = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
             "top_p": "top_p", "seed": "seed", "stop": "stop", "top_k": "top_k", "ignore_eos": "ignore_eos",
             "stop_token_ids": "stop_token_ids", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
             "min_tokens": "min_tokens"}
# Accepted and ignored: they do not change what is generated (logprobs and top_logprobs are read apart).
_IGNORED = {"model", "stream", "stream_options", "user", "n", "messages", "prompt", "echo", "logprobs", "top_logprobs",
            "best_of", "add_generation_prompt", "metadata", "store"}
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def _errors(handler):
    @functools.wraps(handler)
    async def wrapper(self, request: Request):
        try:
            return await handler(self, request)
        except Exception as exc:  # noqa: BLE001 - answered as OpenAI's error object; message_of logs the unexpected ones
            return openai_error(status_of(exc), message_of(exc))

    return wrapper


class OpenAIRoutes:
    def __init__(self, registry: Registry, body_limit: int, tracing: TraceControl | None = None):
        self.registry, self.body_limit = registry, body_limit
        self.tracing = tracing or TraceControl()
        self.templates = Templates(registry.root)

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/embeddings", self.embeddings, methods=["POST"])]

    async def models(self, request: Request) -> Response:
        names = sorted({mv.name for mv in self.registry.all_versions() if mv.ready and mv.runner is not None
                        and (mv.runner.serves == GENERATE or getattr(mv.runner, "embeds", False))})
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "ferry"} for name in names]
            + lora_api.adapter_entries(self.registry)})

    @_errors
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic_ns()
        body = await self._body(request)
        return await self._traced(self._completions, request, body, arrival, "text_completion")

    @_errors
    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic_ns()
        body = await self._body(request)
        return await self._traced(self._chat_completions, request, body, arrival, "chat")

    @_errors
    async def embeddings(self, request: Request) -> Response:
        arrival = time.monotonic_ns()
        body = parse_json(await read_body(request, self.body_limit))
        return JSONResponse(await embeddings.answer(self.registry, body, arrival))

    async def _traced(self, answer, request: Request, body: dict, arrival: int, operation: str) -> Response:
        """`answer(body, arrival, traced)`, with a GenerationTrace when this request is sampled."""
        if self.tracing.active:
            model = body.get("model")
            trace = self.tracing.begin(model if isinstance(model, str) else "", "", arrival, request.headers)
            if trace is not None:
                traced = trace_doors.GenerationTrace(trace, arrival, operation=operation)
                traced.received()
                try:
                    return traced.respond(await answer(body, arrival, traced))
                except BaseException as exc:
                    traced.failed(exc)
                    raise
        return await answer(body, arrival, None)

    async def _completions(self, body: dict, arrival: int, traced) -> Response:
        wanted = choices.counts(body, completions=True)
        mv, adapter = lora_api.resolve(self.registry, model_of(body))
        text, ids = prompt_of(body.get("prompt"))
        given = GenerationInput(arrival, text=text, token_ids=ids, sampling=sampling_of(body, completion_logprobs(body)),
                                lora_name=adapter)
        decoded = mv.runner.decode(given)
        reply = Reply("cmpl", "text_completion", adapter or mv.name, chat=False)
        echo = decoded.prompt_text if body.get("echo") else ""
        return await self._answer(mv, decoded, body, reply, echo, wanted, traced)

    async def _chat_completions(self, body: dict, arrival: int, traced) -> Response:
        wanted = choices.counts(body, completions=False)
        mv, adapter = lora_api.resolve(self.registry, model_of(body))
        plan = tools.plan_of(body, parameter(mv.config, "tool_call_parser", "hermes"))
        messages = body.get("messages")
        if plan is not None and isinstance(messages, list):
            messages = tools.template_messages(messages)
        prompt = self.templates.prompt(mv, messages, bool(body.get("add_generation_prompt", True)),
                                       plan.tools if plan is not None else None)
        sampling = sampling_of(body, chat_logprobs(body))
        enforced = plan.structured() if plan is not None else None
        if enforced is not None:
            if "structured_outputs" in sampling:
                raise InvalidInputError(f"tool_choice {plan.mode!r} constrains the output already; drop 'response_format'")
            sampling.update(enforced)
        decoded = mv.runner.decode(GenerationInput(arrival, text=prompt, sampling=sampling, lora_name=adapter))
        reply = Reply("chatcmpl", "chat.completion", adapter or mv.name, chat=True)
        reply.tools = plan
        return await self._answer(mv, decoded, body, reply, "", wanted, traced)

    async def _answer(self, mv, decoded, body: dict, reply: Reply, echo: str, wanted: choices.ChoiceCounts,
                      traced=None) -> Response:
        """`traced`: the request's GenerationTrace (its request id the reply's), or None when not sampled."""
        wrap = None
        if traced is not None:
            traced.started(mv.version, reply.id, decoded.sampling, wanted.best_of)
            wrap = traced.wrap
        if not body.get("stream"):
            return JSONResponse(await whole_answer(mv.runner, decoded, reply, echo, wanted, wrap))
        streams = {index: tools.ToolStream(reply.tools) for index in range(wanted.n)} if reply.tools else None
        generations = await choices.start(mv.runner, choices.variants(decoded, wanted.best_of, wanted.ranked))
        if wrap is not None:
            generations = [wrap(generation) for generation in generations]
        reply.echo = len(echo)
        options = body.get("stream_options") or {}
        usage = bool(options.get("include_usage")) if isinstance(options, dict) else False

        async def chunks():
            for index in range(wanted.n):
                yield streaming.sse(reply.chunk(index, echo, None, first=True))
            finals = []
            try:
                async with contextlib.aclosing(choices.merged(generations)) as events:
                    async for index, event in events:
                        for chunk in _event_chunks(reply, streams, index, event):
                            yield streaming.sse(chunk)
                        if event.finish_reason is not None:
                            finals.append(event)
                if usage:
                    yield streaming.sse(reply.usage_chunk(finals))
            except Exception as exc:  # noqa: BLE001 - the status is sent: the error travels as an event
                yield streaming.sse(openai_body(exc))
            yield streaming.sse("[DONE]")

        return StreamingResponse(chunks(), media_type="text/event-stream", headers=streaming.SSE_HEADERS)

    async def _body(self, request: Request) -> dict:
        return checked_body(parse_json(await read_body(request, self.body_limit)))


async def whole_answer(runner, decoded, reply: Reply, echo: str, wanted: choices.ChoiceCounts, wrap=None) -> dict:
    """The whole (not streamed) answer: every choice run to its end, the best kept, OpenAI's object.

    `runner` is anything with the runner's `generate(decoded)` (ferry batch's gRPC upstream is one);
    `wrap(generation)`, when given, watches each choice's generation (a trace's)."""
    generations = await choices.start(runner, choices.variants(decoded, wanted.best_of, wanted.ranked))
    if wrap is not None:
        generations = [wrap(generation) for generation in generations]
    reply.echo = len(echo)
    generated = await choices.collect(generations)
    kept = choices.best(generated, wanted.n) if wanted.ranked else generated
    return reply.whole(echo, kept, [c.last for c in generated], decoded.sampling.logprobs is not None)


class Reply:
    """OpenAI's response and chunk objects for one request (one id, one creation time), each choice by index."""

    def __init__(self, prefix: str, kind: str, model: str, chat: bool):
        self.id, self.kind, self.model, self.chat = f"{prefix}-{uuid.uuid4().hex}", kind, model, chat
        self.created = int(time.time())
        self.echo = 0  # characters of echoed prompt in front of every choice's text
        self._offsets: dict[int, int] = {}  # completions' text_offset of each choice's next token
        self.tools: tools.ToolPlan | None = None  # chat with tools: the text becomes tool_calls (tools.py)

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices, **extra}

    def whole(self, echo: str, kept: list, finals: list, asked: bool) -> dict:
        """`kept`: the choices answered (choices.Choice); `finals`: the last event of every choice generated
        (best_of's discarded ones included: their tokens are counted in usage, as OpenAI counts them)."""
        shaped = []
        for choice in kept:
            text, last = echo + "".join(choice.pieces), choice.last
            finish = _FINISH.get(last.finish_reason, last.finish_reason)
            logprobs = self._logprobs(choice.index, choice.logprobs if asked else None)
            shaped.append({"index": choice.index, "message": self._message(text), "finish_reason": finish,
                           "logprobs": logprobs} if self.chat else
                          {"index": choice.index, "text": text, "finish_reason": finish, "logprobs": logprobs})
        if self.tools is not None:
            for choice in shaped:
                if choice["message"].get("tool_calls") and choice["finish_reason"] == "stop":
                    choice["finish_reason"] = "tool_calls"
        return self._object(self.kind, shaped, usage=_usage(finals))

    def _message(self, text: str) -> dict:
        if self.tools is None:
            return {"role": "assistant", "content": text}
        content, calls = self.tools.calls(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [tools.shaped(call) for call in calls]
        return message

    def delta_chunk(self, index: int, delta: dict, finish: str | None, logprobs: list | None = None) -> dict:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": self._logprobs(index, logprobs)}
        return self._object("chat.completion.chunk", [choice])

    def chunk(self, index: int, text: str, finish: str | None, first: bool = False, logprobs: list | None = None) -> dict:
        shaped = self._logprobs(index, logprobs)
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": shaped}
            return self._object("chat.completion.chunk", [choice])
        return self._object(self.kind, [{"index": index, "text": text, "finish_reason": finish, "logprobs": shaped}])

    def _logprobs(self, index: int, entries: list | None) -> dict | None:
        """OpenAI's logprobs object: chat's `content` list, or completions' parallel lists with text offsets."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [{**_chat_logprob(e.sampled), "top_logprobs": [_chat_logprob(t) for t in e.top]}
                                for e in entries]}
        offsets, offset = [], self._offsets.get(index, self.echo)
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.sampled.token)
        self._offsets[index] = offset
        return {"tokens": [e.sampled.token for e in entries], "token_logprobs": [e.sampled.logprob for e in entries],
                "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries], "text_offset": offsets}

    def usage_chunk(self, finals: list) -> dict:
        return self._object("chat.completion.chunk" if self.chat else self.kind, [], usage=_usage(finals))


def _event_chunks(reply: Reply, streams: dict | None, index: int, event) -> list[dict]:
    finish = _FINISH.get(event.finish_reason, event.finish_reason)
    if streams is not None:
        return _tool_chunks(reply, streams[index], index, event, finish)
    if event.text or event.finish_reason is not None or event.logprobs:
        return [reply.chunk(index, event.text, finish, logprobs=event.logprobs)]
    return []


def _tool_chunks(reply: Reply, stream: tools.ToolStream, index: int, event, finish: str | None) -> list[dict]:
    """A streamed event of a chat with tools as chunks: content, tool call deltas, the finish."""
    deltas = stream.feed(event.text)
    if event.finish_reason is not None:
        tail, finish = stream.finish(finish)
        deltas += tail
    chunks = [reply.delta_chunk(index, delta, None, event.logprobs if i == 0 else None) for i, delta in enumerate(deltas)]
    if event.finish_reason is not None:
        chunks.append(reply.delta_chunk(index, {}, finish))
    return chunks


def _usage(finals: list) -> dict:
    """OpenAI's count: the prompt once, the completion tokens of every choice generated."""
    prompt = finals[0].prompt_tokens if finals else 0
    completion = sum(event.completion_tokens for event in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def checked_body(body) -> dict:
    """A request body this API reads: a JSON object of known fields."""
    if not isinstance(body, dict):
        raise InvalidInputError("the request body must be a JSON object")
    unknown = set(body) - set(_SAMPLING) - _IGNORED - STRUCTURED_FIELDS - tools.FIELDS
    if unknown:
        raise InvalidInputError(f"unsupported fields {sorted(unknown)[:10]}")
    return body


def model_of(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidInputError("'model' must name a generation model (GET /v1/models lists them)")
    return model


def prompt_of(prompt) -> tuple[str | None, list[int] | None]:
    """A string, a list of token ids, or a one-element list of either (batches are not supported)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        return None, prompt
    raise InvalidInputError("'prompt' must be a string or a list of token ids (one prompt per request)")


def _chat_logprob(value) -> dict:
    return {"token": value.token, "logprob": value.logprob, "bytes": list(value.token.encode())}


def completion_logprobs(body: dict):
    """Completions' `logprobs` is the number of alternatives (0: the sampled token's only); the decoder checks it."""
    value = body.get("logprobs")
    return None if value is None or value is False else value


def chat_logprobs(body: dict):
    """Chat asks with `logprobs: true` and counts alternatives with `top_logprobs` (OpenAI's rules)."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked not in (None, True, False):
        raise InvalidInputError(f"'logprobs' must be true or false, got {asked!r}")
    if not asked:
        if top is not None:
            raise InvalidInputError("'top_logprobs' needs 'logprobs': true")
        return None
    return 0 if top is None else top


def sampling_of(body: dict, logprobs=None) -> dict:
    sampling = {"temperature": 1.0}  # OpenAI's default; send 0 for greedy
    for field, key in _SAMPLING.items():
        if body.get(field) is not None:
            sampling[key] = body[field]
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    sampling.update(structured_of(body))
    return sampling

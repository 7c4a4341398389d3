"""Triton's generate extension: POST /v2/models/{name}/generate and /generate_stream (SSE).

The JSON's keys are what Triton's vLLM backend reads as inputs (`text_input`, `max_tokens`, `stream`,
`exclude_input_in_output`, `sampling_parameters`) and its `parameters` are sampling parameters; the
answer is `text_output` (with the prompt in front for /generate unless excluded, as that backend
does), then `finish_reason` and usage. Decoding and checking are the generation runner's. Any other
model (a decoupled Python model, say) takes inputs by name instead (web/generate_tensors.py).
"""

from __future__ import annotations

import contextlib
import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from server.errors import InvalidInputError
from server.doors.shared import serving
from server.names import shown
from server.repository.registry import Registry
from server.runners.base import DECOUPLED, GENERATE, INFER
from server.runners.generation import GenerationInput
from server.runners.sampling import KEYS as SAMPLING_KEYS
from server.runners.sampling import from_strings
from server.observability.tracing import doors as trace_doors
from server.observability.tracing.control import TraceControl
from server.doors.http import generate_tensors, streaming
from server.doors.http.body import read_body
from server.doors.http.errors import message_of
from server.doors.http.kserve import kserve_errors, model_paths
from server.doors.http.tensors import parse_json

_INPUTS = {"text_input", "max_tokens", "stream", "exclude_input_in_output", "sampling_parameters", "parameters", "id",
           "lora_name"}


class GenerateRoutes:
    def __init__(self, registry: Registry, body_limit: int, tracing: TraceControl | None = None):
        self.registry, self.body_limit = registry, body_limit
        self.tracing = tracing or TraceControl()

    def routes(self) -> list[Route]:
        return ([Route(p, self.generate, methods=["POST"]) for p in model_paths("/generate")]
                + [Route(p, self.generate_stream, methods=["POST"]) for p in model_paths("/generate_stream")])

    @kserve_errors
    async def generate(self, request: Request) -> Response:
        tensor_model = self._tensor_model(request)
        if tensor_model is not None:  # not a generation model: inputs and outputs by name, as Triton
            body = await self._body(request)
            infer = generate_tensors.request(tensor_model, body, self.body_limit)
            answers = [r async for r in generate_tensors.responses(tensor_model, infer)]
            return JSONResponse(generate_tensors.one_answer(answers))
        mv, body, generation, traced = await self._start(request)
        text, last = await (generation.collect() if traced is None else traced.collect(generation))
        response = JSONResponse(answer(mv.name, mv.version, whole_text(body, text), last, body.get("id")))
        return response if traced is None else traced.respond(response)

    @kserve_errors
    async def generate_stream(self, request: Request) -> Response:
        tensor_model = self._tensor_model(request)
        if tensor_model is not None:
            return await self._tensor_stream(tensor_model, await self._body(request))
        mv, body, generation, traced = await self._start(request)
        events = generation.events() if traced is None else traced.events(generation.events())

        async def frames():
            try:
                async for event in events:
                    yield streaming.sse(answer(mv.name, mv.version, event.text, event, body.get("id")))
            except Exception as exc:  # noqa: BLE001 - the status is sent: the error travels as an event
                yield streaming.sse({"error": message_of(exc)})

        response = StreamingResponse(frames(), media_type="text/event-stream", headers=streaming.SSE_HEADERS)
        return response if traced is None else traced.respond(response)

    def _tensor_model(self, request: Request):
        """The model, when it is one that answers with tensors (a decoupled or batching model), else None."""
        mv = self.registry.get(request.path_params["name"], request.path_params.get("version", ""))
        return mv if mv.runner.serves in (DECOUPLED, INFER) else None

    async def _body(self, request: Request) -> dict:
        return generate_tensors.parse_body(await read_body(request, self.body_limit))

    async def _tensor_stream(self, mv, body: dict) -> Response:
        """A request refused before it runs gets its own status and a JSON error; once it runs, the status
        is 200 and a failure (the model's first response included) travels as an `error` event, as Triton."""
        infer = generate_tensors.request(mv, body, self.body_limit)  # checked here, so a bad request is answered with its status
        responses = generate_tensors.responses(mv, infer)

        async def frames():
            async with contextlib.aclosing(responses):
                try:
                    async for response in responses:
                        yield streaming.sse(response)
                except Exception as exc:  # noqa: BLE001 - the status is sent: the error travels as an event
                    yield streaming.sse({"error": message_of(exc)})

        return StreamingResponse(frames(), media_type="text/event-stream", headers=streaming.SSE_HEADERS)

    async def _start(self, request: Request):
        """(model version, body, started generation, its GenerationTrace or None when not sampled)."""
        arrival = time.monotonic_ns()
        traced = None
        if self.tracing.active:
            trace = self.tracing.begin(request.path_params["name"], "", arrival, request.headers)
            traced = trace_doors.GenerationTrace(trace, arrival) if trace is not None else None
        try:
            return (*await self._begin(request, arrival, traced), traced)
        except BaseException as exc:
            if traced is not None:
                traced.failed(exc)
            raise

    async def _begin(self, request: Request, arrival: int, traced):
        mv = serving(self.registry, request.path_params["name"], request.path_params.get("version", ""), GENERATE)
        body = parse_json(await read_body(request, self.body_limit))
        if traced is not None:
            traced.received()
        decoded = mv.runner.decode(generation_input(body, arrival))
        if traced is not None:
            traced.started(mv.version, str(body.get("id", "")), decoded.sampling)
        return mv, body, await streaming.start(mv.runner, decoded)


def generation_input(body, arrival_ns: int) -> GenerationInput:
    """A generate body for a generation model, read (its values are the runner's decoder's to check)."""
    if not isinstance(body, dict) or not isinstance(body.get("text_input"), str):
        raise InvalidInputError("the generate request must be a JSON object with a string 'text_input'")
    unknown = set(body) - _INPUTS - SAMPLING_KEYS
    if unknown:
        raise InvalidInputError(f"unknown fields {shown(str(sorted(unknown)))}; send sampling parameters in 'parameters'")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInputError("'parameters' must be a JSON object")
    sampling = {k: v for k, v in {**body, **params}.items() if k in SAMPLING_KEYS}
    if "sampling_parameters" in body:
        sampling.update(_json_object(body["sampling_parameters"]))
    return GenerationInput(arrival_ns, text=body["text_input"], sampling=from_strings(sampling),
                           priority=params.get("priority", 0), timeout_us=params.get("timeout", 0),
                           lora_name=body.get("lora_name") or params.get("lora_name") or "")


def whole_text(body: dict, text: str) -> str:
    """/generate's text_output: the prompt in front unless excluded (as Triton's vLLM backend answers)."""
    return text if body.get("exclude_input_in_output", False) else body["text_input"] + text


def _json_object(raw) -> dict:
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError as exc:
        raise InvalidInputError(f"'sampling_parameters' is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidInputError("'sampling_parameters' must be a JSON object (or a string holding one)")
    return value


def answer(model: str, version, text: str, event, request_id=None) -> dict:
    """Triton's generate response: the request's `id` echoed (when given and not empty), then the text."""
    out = {"id": request_id} if isinstance(request_id, str) and request_id else {}
    out.update(model_name=model, model_version=str(version), text_output=text)
    if event.finish_reason is not None:
        out["finish_reason"] = event.finish_reason
        out["usage"] = {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens}
    return out

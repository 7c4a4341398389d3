"""What a front door does for a sampled request: the protocol's timestamps around the call it makes anyway.

Each helper is called only when `TraceControl.begin` answered a trace, so an untraced request never
reaches this module. gRPC's send end is the call's done callback (the status has gone out); HTTP's is a
background task Starlette runs once the body is sent.
"""

from __future__ import annotations

import time
from typing import Awaitable

from starlette.background import BackgroundTask
from starlette.responses import Response

from server.errors import ModelNotFoundError
from server.observability.tracing import record as r

BACKEND_OUTPUT, QUEUE_INPUT = r.TENSOR_BACKEND_OUTPUT, r.TENSOR_QUEUE_INPUT


def check_model(registry, model: str) -> None:
    """Trace settings for a model name the repository does not have are refused (Triton: unknown model)."""
    if model and not (registry.knows(model) or registry.on_disk(model)):
        raise ModelNotFoundError(f"Request for unknown model : {model} (trace settings)")


def grpc_carrier(context) -> dict[str, str]:
    """The call's metadata as a header map (for a W3C traceparent)."""
    return {key: value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)}


def attach(trace: r.Trace, infer, version: int) -> None:
    """The decoded request enters the server's core: REQUEST_START; its trace rides the InferRequest."""
    trace.model_version = version
    trace.request_id = infer.id
    infer.trace = trace
    trace.mark(r.REQUEST_START)
    trace.tensor(QUEUE_INPUT, infer.inputs)


def answered(trace: r.Trace, outputs: dict) -> None:
    trace.mark(r.REQUEST_END)
    trace.tensor(BACKEND_OUTPUT, outputs)


async def grpc_unary(trace: r.Trace, arrival_ns: int, context, call: Awaitable):
    """ModelInfer traced: WAITREAD at arrival (grpc has read the message by then), SEND_START when the
    answer is handed back to grpc, SEND_END when the call is over."""
    trace.mark(r.GRPC_WAITREAD_START, arrival_ns)
    trace.mark(r.GRPC_WAITREAD_END, arrival_ns)
    context.add_done_callback(lambda _: _end(trace, r.GRPC_SEND_END))
    try:
        response = await call
    except BaseException as exc:
        trace.attributes["error"] = f"{type(exc).__name__}: {exc}"
        raise
    trace.mark(r.GRPC_SEND_START)
    return response


async def http_unary(trace: r.Trace, arrival_ns: int, call: Awaitable[Response]) -> Response:
    """KServe v2 /infer traced: RECV_START at arrival (the handler marks RECV_END once the body is read),
    SEND_START when the response is built, SEND_END once Starlette has sent it."""
    trace.mark(r.HTTP_RECV_START, arrival_ns)
    try:
        response = await call
    except BaseException as exc:
        trace.attributes["error"] = f"{type(exc).__name__}: {exc}"
        _end(trace, None)
        raise
    trace.mark(r.HTTP_SEND_START)
    response.background = BackgroundTask(_sent, trace)  # async: run on the loop, not in a thread pool
    return response


async def _sent(trace: r.Trace) -> None:
    if r.HTTP_SEND_START not in (name for name, _ in trace.timestamps):  # a stream that ended without a last event
        trace.mark(r.HTTP_SEND_START)
    _end(trace, r.HTTP_SEND_END)


def _end(trace: r.Trace, last: str | None) -> None:
    if last is not None:
        trace.mark(last)
    trace.finish()


class GenerationTrace:
    """A generation's trace: a timestamp per streamed response, the first also FIRST_TOKEN; once every
    choice has finished, the usage and timings become the GenAI semantic-convention attributes."""

    def __init__(self, trace: r.Trace, arrival_ns: int, context=None, stream: bool = False,
                 operation: str = "text_completion"):
        """`context`: the gRPC call's (its end is GRPC_SEND_END); None: an HTTP request (`respond`).
        `stream`: a request on ModelStreamInfer (streams.py marks its reads and sends, and ends it), or a
        BLS call, which no door sends (runners/model_calls.py ends it).
        `operation`: the GenAI operation name (`chat` for OpenAI's chat completions)."""
        self.trace = trace
        self.arrival_ns = arrival_ns
        self.first = True
        self.http = context is None and not stream
        self.stream = stream
        self.operation = operation
        self.left = 1  # choices still generating (OpenAI's n, best_of)
        self.output_tokens = 0
        self.finish_reasons: list[str] = []
        if self.http:
            trace.mark(r.HTTP_RECV_START, arrival_ns)
        elif not stream:
            trace.mark(r.GRPC_WAITREAD_START, arrival_ns)
            trace.mark(r.GRPC_WAITREAD_END, arrival_ns)
            context.add_done_callback(lambda _: _end(trace, r.GRPC_SEND_END))
        trace.attributes["span.name"] = f"{operation} {trace.model_name}"

    def received(self) -> None:
        """HTTP: the body has been read."""
        self.trace.mark(r.HTTP_RECV_END)

    def respond(self, response: Response) -> Response:
        """HTTP: the trace ends once Starlette has sent the whole response (a stream's last event included)."""
        response.background = BackgroundTask(_sent, self.trace)
        return response

    async def collect(self, generation) -> tuple[str, object]:
        """HTTP /generate: streaming.Generation.collect, each event marked."""
        pieces, last = [], generation.first
        try:
            async for event in self.events(generation.events()):
                pieces.append(event.text)
                last = event
        except BaseException as exc:
            self.failed(exc)
            raise
        return "".join(pieces), last

    async def events(self, events):
        """The generation's events, each marked as it passes."""
        async for event in events:
            self.event(event)
            yield event

    def wrap(self, generation) -> _Marked:
        """An HTTP door's started generation (streaming.Generation) whose events are marked as they pass."""
        return _Marked(self, generation)

    def started(self, version: int, request_id: str, sampling, choices: int = 1) -> None:
        """`choices`: generations this request runs (OpenAI's n or best_of); the trace's end waits for all."""
        trace = self.trace
        self.left = choices
        trace.model_version, trace.request_id = version, request_id
        trace.mark(r.REQUEST_START)
        trace.mark(r.QUEUE_START)
        trace.attributes.update({"gen_ai.operation.name": self.operation, "gen_ai.system": "ferry",
                                 "gen_ai.request.model": trace.model_name,
                                 "gen_ai.request.max_tokens": sampling.max_tokens,
                                 "gen_ai.request.temperature": sampling.temperature,
                                 "gen_ai.request.top_p": sampling.top_p})

    def event(self, event) -> None:
        now = time.monotonic_ns()
        if self.first:
            self.trace.mark(r.FIRST_TOKEN, now)
            self.first = False
        self.trace.mark(r.INFER_RESPONSE_COMPLETE, now)
        if event.finish_reason is not None:
            self.left -= 1
            self.output_tokens += event.completion_tokens
            self.finish_reasons.append(event.finish_reason)
            if self.left <= 0:
                self._last(event, now)

    def _last(self, event, now: int) -> None:
        trace = self.trace
        compute = max(self.arrival_ns + int(event.queue_ms * 1e6), trace.first(r.QUEUE_START) or self.arrival_ns)
        trace.mark(r.COMPUTE_START, min(compute, now))
        trace.mark(r.COMPUTE_END, now)
        trace.mark(r.REQUEST_END)
        if not self.stream:  # a stream's sends are marked per response as they are written (streams.py)
            trace.mark(r.HTTP_SEND_START if self.http else r.GRPC_SEND_START)
        trace.attributes.update({
            "gen_ai.usage.input_tokens": event.prompt_tokens, "gen_ai.usage.output_tokens": self.output_tokens,
            "gen_ai.response.finish_reasons": self.finish_reasons,
            "gen_ai.latency.time_to_first_token": event.ttft_ms / 1e3,
            "gen_ai.latency.time_in_queue": event.queue_ms / 1e3, "gen_ai.latency.e2e": event.total_ms / 1e3})

    def failed(self, exc: BaseException) -> None:
        """HTTP: the request failed before its response was built; the trace ends now."""
        self.trace.attributes["error"] = f"{type(exc).__name__}: {exc}"
        _end(self.trace, None)


class _Marked:
    """A started generation (the HTTP door's streaming.Generation) whose events its trace marks."""

    __slots__ = ("traced", "generation", "first")

    def __init__(self, traced: GenerationTrace, generation):
        self.traced, self.generation, self.first = traced, generation, generation.first

    async def events(self):
        async for event in self.generation.events():
            self.traced.event(event)
            yield event

    async def close(self) -> None:
        await self.generation.close()

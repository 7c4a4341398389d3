"""Register a service whose handlers receive raw bytes and parse them inside Ferry's code.

grpc's generated `add_*_to_server` parses a request before any servicer code runs; a body that does
not parse then fails inside grpc, is logged as an ERROR traceback per call, and reaches the client
as UNKNOWN. Here the handlers are built from the service descriptor with a pass-through
deserializer, so the parse happens in the wrapper below: an undecodable unary or server-streaming
request is INVALID_ARGUMENT naming the message type; an undecodable message on a client stream is
handed to the servicer as an `Undecodable` in its place, so ModelStreamInfer can answer it with
`error_message` and keep the stream going, as it does for every other bad request on a stream.
Bad bodies are counted and logged at most once a minute, never with a traceback.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from server.doors.grpc.errors import abort_for
from server.errors import InvalidInputError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """Stands in a client stream for a message that did not parse. `id` and `model_name` are empty,
    so the stream's ordinary error path can answer it like any other failed request."""

    error: InvalidInputError
    id: str = ""
    model_name: str = ""


class MalformedBodies:
    """Counts undecodable bodies per method; logs a summary line at most once per `interval_s`."""

    def __init__(self, interval_s: float = 60.0, clock=time.monotonic):
        self.counts: Counter[str] = Counter()
        self._interval_s = interval_s
        self._clock = clock
        self._logged_at: float | None = None
        self._since_log = 0
        self._lock = threading.Lock()

    def record(self, method: str, error: str) -> None:
        with self._lock:
            self.counts[method] += 1
            self._since_log += 1
            now = self._clock()
            if self._logged_at is not None and now - self._logged_at < self._interval_s:
                return
            count, self._since_log, self._logged_at = self._since_log, 0, now
        log.warning("%d undecodable request bod%s answered INVALID_ARGUMENT (latest: %s: %s)",
                    count, "y" if count == 1 else "ies", method, error)


def add_service(servicer, service_name: str, server, bodies: MalformedBodies) -> None:
    """Serve every method of `service_name` (from the default descriptor pool) from `servicer`, as a generic
    handler (`server`: a grpc.aio server or gates.ServiceHandlers; no method registered, see gates.py)."""
    service = descriptor_pool.Default().FindServiceByName(service_name)
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        parse = body_parser(request_cls, f"{service.full_name}/{method.name}", bodies)
        behavior = getattr(servicer, method.name)
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            behavior = _unimplemented(method.name, method.server_streaming)  # generated base class stub
        kind = (method.client_streaming, method.server_streaming)
        build, wrapped = {
            (False, False): (grpc.unary_unary_rpc_method_handler, _unary(behavior, parse)),
            (False, True): (grpc.unary_stream_rpc_method_handler, _unary_stream(behavior, parse)),
            (True, False): (grpc.stream_unary_rpc_method_handler, _stream(behavior, parse)),
            (True, True): (grpc.stream_stream_rpc_method_handler, _stream_stream(behavior, parse)),
        }[kind]
        handlers[method.name] = build(wrapped, request_deserializer=None, response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def serialize(response) -> bytes:
    """A handler may answer with the message or with its bytes already composed (ModelInfer:
    response_bytes.py)."""
    return response if response.__class__ is bytes else response.SerializeToString()


def body_parser(request_cls, method: str, bodies: MalformedBodies):
    type_name = request_cls.DESCRIPTOR.full_name

    def parse(raw: bytes):
        try:
            return request_cls.FromString(raw)
        except (DecodeError, ValueError, RecursionError) as exc:  # upb reports malformed wire data as DecodeError
            detail = str(exc) or type(exc).__name__
            bodies.record(method, detail)
            raise InvalidInputError(f"request body is not a valid {type_name}: {detail}") from None

    return parse


def _unimplemented(name: str, streaming: bool):
    message = f"{name} is not implemented by Ferry"
    if streaming:
        async def stream(request, context):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)
            yield  # pragma: no cover - makes this an async generator

        return stream

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

    return unary


def _unary(behavior, parse):
    method = getattr(behavior, "translated", None)
    if method is not None:
        return _unary_translated(method.__get__(behavior.__self__), parse, method.__name__)

    async def handler(raw, context):
        try:
            request = parse(raw)
        except InvalidInputError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        return await behavior(request, context)

    return handler


def _unary_translated(method, parse, name: str):
    """`_unary` for a method under `errors.translate_errors`, its error handling done here (the ModelInfer of
    every request: a coroutine less for each)."""
    async def handler(raw, context):
        try:
            request = parse(raw)
        except InvalidInputError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        try:
            return await method(request, context)
        except Exception as exc:  # noqa: BLE001 - the server keeps serving whatever a handler hits
            await abort_for(exc, context, name)

    return handler


def _unary_stream(behavior, parse):
    async def handler(raw, context):
        try:
            request = parse(raw)
        except InvalidInputError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        async with contextlib.aclosing(behavior(request, context)) as responses:
            async for response in responses:
                yield response

    return handler


async def _parsed(raw_iterator, parse):
    async for raw in raw_iterator:
        try:
            yield parse(raw)
        except InvalidInputError as exc:
            yield Undecodable(exc)


def _stream(behavior, parse):
    async def handler(raw_iterator, context):
        return await behavior(_parsed(raw_iterator, parse), context)

    return handler


def _stream_stream(behavior, parse):
    async def handler(raw_iterator, context):
        async with contextlib.aclosing(behavior(_parsed(raw_iterator, parse), context)) as responses:
            async for response in responses:
                yield response

    return handler

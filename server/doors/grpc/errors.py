"""Domain errors -> gRPC status codes: the one table, applied by a decorator on every RPC."""

from __future__ import annotations

import contextlib
import functools
import logging

import grpc

from server import errors
from server.names import capped

log = logging.getLogger(__name__)

STATUS = {
    errors.InvalidInputError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ModelNotFoundError: grpc.StatusCode.NOT_FOUND,
    errors.ModelUnavailableError: grpc.StatusCode.UNAVAILABLE,
    # Triton answers a full queue with UNAVAILABLE; tritonclient users and the KServe SDK's retry
    # policy both expect that code, so Ferry keeps it.
    errors.QueueFullError: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.BackendError: grpc.StatusCode.INTERNAL,
    errors.ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UnsupportedError: grpc.StatusCode.UNIMPLEMENTED,
    errors.RegionNotFoundError: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExistsError: grpc.StatusCode.ALREADY_EXISTS,  # as Triton answers a region registered twice
    errors.DisabledError: grpc.StatusCode.PERMISSION_DENIED,  # the server's flags forbid it, whoever asks
    errors.UnknownError: grpc.StatusCode.UNKNOWN,
    errors.RequestCancelledError: grpc.StatusCode.CANCELLED,
    errors.ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,  # a model larger than the memory budget
}


def status_of(exc: errors.FerryError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.UNKNOWN


def translate_errors(method):
    """Turn FerryError into the mapped status; anything unexpected becomes INTERNAL, logged once.

    `wrapper.translated` is the method itself: a caller that handles errors as this does (passthrough.py's
    unary handler) awaits it directly, one coroutine per call instead of two."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - the server keeps serving whatever a handler hits
            await abort_for(exc, context, method.__name__)

    wrapper.translated = method
    return wrapper


def translate_stream_errors(method):
    """`translate_errors` for server-streaming handlers (async generators)."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            async with contextlib.aclosing(method(self, request, context)) as responses:
                async for response in responses:
                    yield response
        except Exception as exc:  # noqa: BLE001 - the server keeps serving whatever a handler hits
            await abort_for(exc, context, method.__name__)

    return wrapper


async def abort_for(exc: Exception, context, name: str) -> None:
    """The call's status for what its handler raised: a FerryError's own, INTERNAL (logged) for the rest;
    an abort already under way passes through."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if isinstance(exc, errors.FerryError):
        code, details = status_of(exc), capped(exc.message)
    else:
        log.exception("unexpected error in %s", name, exc_info=exc)
        code, details = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
    # gRPC keeps the AbortError it raises on the call's state, and that error's context is `exc`: with its
    # traceback, every frame it passed (a generation stream's request, sequence, tensors) lives as long as
    # gRPC holds the call, which after a client's deadline can be well past the call's end (a cancel storm
    # left one deadline-expired stream alive a minute later, tests/integration/test_cancel_storm.py).
    exc.__traceback__ = None
    await context.abort(code, details)

"""Every RPC a front-end process does not specialise, relayed as raw bytes to the engine's private gRPC socket.

Metadata (bearer tokens included), the remaining deadline, cancellation, the status code, its message
and the trailing metadata all cross unchanged, so metadata, statistics, repository control, health,
streams, generation and shared memory registration behave exactly as in one process: the engine
answers them. Bodies are never parsed here.
"""

from __future__ import annotations

import contextlib

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2  # noqa: F401 - puts the services in the default pool, for _kind
from grpc_reflection.v1alpha import reflection_pb2  # noqa: F401

from protos import generate_pb2, grpc_service_pb2  # noqa: F401

# Set by the caller in the front end's own metadata; forwarding them would duplicate or contradict it.
_NOT_FORWARDED = ("user-agent", "grpc-")


def _metadata(context) -> tuple:
    return tuple((k, v) for k, v in context.invocation_metadata() or ()
                 if not k.startswith(":") and not k.startswith(_NOT_FORWARDED))


def _kind(method: str) -> tuple[bool, bool] | None:
    """(client streaming, server streaming) of a method of a service in the default pool, else None."""
    service, _, name = method.lstrip("/").rpartition("/")
    try:
        found = descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name)
    except KeyError:
        return None
    return None if found is None else (found.client_streaming, found.server_streaming)


class Relay(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.aio.Channel, skip: frozenset[str] = frozenset()):
        self.channel = channel
        self.skip = skip  # methods served by the front end itself

    def service(self, details: grpc.HandlerCallDetails):
        kind = _kind(details.method)
        if details.method in self.skip or kind is None:
            # Every service the engine serves is in the default pool, so a method missing from it is one the
            # engine would answer UNIMPLEMENTED: gRPC answers it here the same, without a relay. (Relaying
            # it as a stream both ways let a unary caller race the engine's early status into INTERNAL.)
            return None
        return _HANDLERS[kind](self, details.method)

    async def unary(self, method: str, raw: bytes, context):
        call = self.channel.unary_unary(method)(raw, metadata=_metadata(context), timeout=context.time_remaining())
        return await self._finished(call, context)

    async def client_stream(self, method: str, raws, context):
        call = self.channel.stream_unary(method)(raws, metadata=_metadata(context), timeout=context.time_remaining())
        return await self._finished(call, context)

    async def _finished(self, call, context):
        try:
            return await call
        except grpc.aio.AioRpcError as err:
            await _relay_status(err, context)
        finally:
            call.cancel()  # a no-op once it is done; a cancelled client call cancels the engine's

    async def streamed(self, multi, request, context):
        """Server streaming (`request` one body) and bidirectional (`request` the client's stream)."""
        call = multi(request, metadata=_metadata(context), timeout=context.time_remaining())
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as err:
            await _relay_status(err, context)
        finally:
            call.cancel()


def _unary_unary(relay: Relay, method: str):
    async def handler(raw, context):
        return await relay.unary(method, raw, context)

    return grpc.unary_unary_rpc_method_handler(handler)


def _unary_stream(relay: Relay, method: str):
    async def handler(raw, context):
        async for response in relay.streamed(relay.channel.unary_stream(method), raw, context):
            yield response

    return grpc.unary_stream_rpc_method_handler(handler)


def _stream_unary(relay: Relay, method: str):
    async def handler(raws, context):
        return await relay.client_stream(method, raws, context)

    return grpc.stream_unary_rpc_method_handler(handler)


def _stream_stream(relay: Relay, method: str):
    async def handler(raws, context):
        async for response in relay.streamed(relay.channel.stream_stream(method), raws, context):
            yield response

    return grpc.stream_stream_rpc_method_handler(handler)


# (client streaming, server streaming) -> the handler kind relaying it
_HANDLERS = {(False, False): _unary_unary, (False, True): _unary_stream, (True, False): _stream_unary,
             (True, True): _stream_stream}


async def _relay_status(err: grpc.aio.AioRpcError, context) -> None:
    with contextlib.suppress(Exception):
        context.set_trailing_metadata(err.trailing_metadata() or ())
    await context.abort(err.code(), err.details() or "")

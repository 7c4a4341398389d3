"""A handler's error must not keep its frames alive after the call: gRPC holds the AbortError it raises
on the call's state, and that error's context is the handler's error, so the error's traceback would pin
everything the handler's frames held (a generation stream's request and sequence) for as long as gRPC
keeps the call. Here the call state is kept on purpose, as gRPC sometimes does past a client's deadline."""

from __future__ import annotations

import asyncio
import gc
import weakref

import grpc
import pytest

from server.doors.grpc.errors import translate_errors, translate_stream_errors
from server.errors import DeadlineExceededError


class Held:
    """Stands for what a handler's frames hold: the request's objects."""


class Servicer:
    def __init__(self):
        self.contexts, self.held = [], []

    def _fail(self, context):
        self.contexts.append(context)  # the call's state outlives the call, as gRPC's can
        held = Held()
        self.held.append(weakref.ref(held))
        raise DeadlineExceededError(f"deadline passed while {held!r} waited")

    @translate_errors
    async def Unary(self, request, context):
        self._fail(context)

    @translate_stream_errors
    async def Stream(self, request, context):
        yield b"first"
        self._fail(context)


async def call_both(servicer: Servicer) -> tuple[list[grpc.StatusCode], list[bytes]]:
    server = grpc.aio.server()
    handlers = {"Unary": grpc.unary_unary_rpc_method_handler(servicer.Unary),
                "Stream": grpc.unary_stream_rpc_method_handler(servicer.Stream)}
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Held", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    codes, streamed = [], []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for call in (channel.unary_unary("/test.Held/Unary")(b"x", timeout=60),
                         channel.unary_stream("/test.Held/Stream")(b"x", timeout=60)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    if hasattr(call, "__aiter__"):
                        async for message in call:
                            streamed.append(message)
                    else:
                        await call
                codes.append(info.value.code())
    finally:
        await server.stop(None)
    return codes, streamed


def test_an_aborted_calls_kept_state_does_not_hold_the_handlers_frames():
    servicer = Servicer()
    codes, streamed = asyncio.run(call_both(servicer))
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2
    assert streamed == [b"first"]  # the stream's response before its error reached the client
    assert len(servicer.contexts) == 2  # gRPC's call state, kept alive here
    gc.collect()
    assert [ref() for ref in servicer.held] == [None, None]

"""A handler that answers one status without running the method: what gates return to refuse a call.

It keeps the refused method's kind (unary or streaming) so gRPC accepts it, and takes the request as
raw bytes, so a refused body is never parsed.
"""

from __future__ import annotations

import grpc


def refusal(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler | None:
    """A handler of `handler`'s kind that aborts with `code`; None (unknown method) stays None."""
    if handler is None:
        return None

    async def unary(request, context):
        await context.abort(code, message)

    async def streaming(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)

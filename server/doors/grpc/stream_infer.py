"""ModelStreamInfer, Triton's bidirectional stream: many requests in, their responses out.

Requests to ordinary models are answered exactly once each, in the order they arrived on the stream
(while they run concurrently, so they still batch). Requests to generation models (decoupled) are
read with Triton's vLLM tensor conventions (runners/generation_tensors.py) and answered as their tokens come; each
response carries `triton_final_response`. Decoupled python models answer 0..N times as the model
yields, each with `triton_final_response: false`; as in Triton, the end is marked by an empty final
response when the request asks for one (`triton_enable_empty_final_response`, tritonclient's
`enable_empty_final_response=True`). Errors go back as `error_message` and the stream goes on; a
stream opened with the header `triton_grpc_error: true` (Triton's) ends at its first error instead,
with that error's gRPC status, and what would follow it is dropped.
A sampled request is traced on its own (tracing/streams.py): its responses travel to the writer
wrapped, so the writer can mark each send; an untraced one costs one check of `tracing.active`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from protos import grpc_service_pb2 as pb
from server.errors import BackendError, FerryError
from server.names import capped
from server.repository.registry import ModelVersion, Registry
from server.doors.grpc import vllm_tensors
from server.doors.shared import serving
from server.doors.grpc.passthrough import Undecodable
from server.observability.tracing import streams as traced
from server.observability.tracing.doors import GenerationTrace
from server.runners import generation_tensors
from server.runners.base import DECOUPLED, GENERATE

# (request, arrival, its trace or None) -> the answer
InferOne = Callable[[pb.ModelInferRequest, int, Any], Awaitable[pb.ModelInferResponse]]
StreamOne = Callable[[pb.ModelInferRequest, int, Any], AsyncIterator[pb.ModelInferResponse]]


async def stream_infer(registry: Registry, requests: AsyncIterator[pb.ModelInferRequest], infer_one: InferOne,
                       deadline_ns: int | None = None, stream_one: StreamOne | None = None,
                       tracing: traced.StreamTracing | None = None,
                       errors_end: bool = False) -> AsyncIterator[pb.ModelStreamInferResponse]:
    """`deadline_ns`: the stream's own gRPC deadline, which bounds every generation on it;
    `stream_one`: answers a request to a decoupled model, 0..N responses; `tracing`: samples requests;
    `errors_end`: the first error is raised (a FerryError: the caller ends the stream with its status)."""
    out: asyncio.Queue = asyncio.Queue()
    tasks: set[asyncio.Task] = set()
    previous: asyncio.Future | None = None  # the last ordered answer, which the next one waits for

    async def read() -> None:
        nonlocal previous
        try:
            async for request in requests:
                turn = asyncio.get_running_loop().create_future()
                task = asyncio.create_task(_serve(registry, request, (infer_one, stream_one, errors_end), out, previous,
                                                  turn, deadline_ns, tracing))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                previous = turn
            await asyncio.gather(*list(tasks))
        finally:
            out.put_nowait(None)  # however reading ended, the response side must too

    reader = asyncio.create_task(read())
    writing = None  # a traced answer being written
    try:
        while (item := await out.get()) is not None:
            if isinstance(item, FerryError):
                raise item
            if item.__class__ is not traced.Sending:
                yield item
                continue
            if item.response is not None:
                writing = item
                item.writing()
                yield item.response
                item.written()
                writing = None
            item.done()
    finally:
        reader.cancel()
        for task in list(tasks):
            task.cancel()
        left = [writing] if writing is not None else []
        while not out.empty():
            left.append(out.get_nowait())
        for item in left:  # traced answers never written: their traces end with what they have
            if item.__class__ is traced.Sending:
                traced.abandoned(item.trace)


async def _serve(registry, request, answer, out, previous, turn, deadline_ns, tracing) -> None:
    arrival = time.monotonic_ns()
    infer_one, stream_one, errors_end = answer
    trace = None
    try:
        if isinstance(request, Undecodable):  # a message that did not parse: answered here, the stream goes on
            raise request.error
        if tracing is not None and tracing.active:
            trace = tracing.begin(request.model_name, request.id, arrival)
        remaining = None if deadline_ns is None else max(0.0, (deadline_ns - arrival) / 1e9)
        async with registry.lease(request.model_name, remaining):  # on demand: its model loaded first
            serves = registry.get(request.model_name, request.model_version).runner.serves
            if serves == DECOUPLED and stream_one is not None:
                turn.set_result(None)  # its responses interleave freely with the others
                await _decoupled(stream_one(request, arrival, trace), request, out, trace)
                return
            if serves == GENERATE:
                turn.set_result(None)  # decoupled: its responses interleave freely with the others
                async with contextlib.aclosing(_generate(registry, request, arrival, deadline_ns, trace)) as responses:
                    async for response, final in responses:
                        _put(out, pb.ModelStreamInferResponse(infer_response=_final(response, final)), trace, final)
                return
            response = pb.ModelStreamInferResponse(infer_response=_final(await infer_one(request, arrival, trace), True))
    except Exception as exc:  # noqa: BLE001 - one request's failure is reported on the stream, which goes on
        message = capped(exc.message if isinstance(exc, FerryError) else f"internal error: {type(exc).__name__}: {exc}")
        response = _failed(request, exc, message, errors_end)
        if trace is not None:
            traced.failed(trace, message)
    except BaseException:  # cancelled: the stream is over
        traced.abandoned(trace)
        raise
    if previous is not None:
        try:
            await previous
        except BaseException:  # cancelled while waiting its turn: the stream is over
            traced.abandoned(trace)
            raise
    _put(out, response, trace, True)
    if not turn.done():
        turn.set_result(None)


def _failed(request: pb.ModelInferRequest, exc: Exception, message: str, errors_end: bool):
    """A request's error on the stream; with `errors_end`, the error that ends the stream (after the
    responses before it, in their order)."""
    if errors_end:
        return exc if isinstance(exc, FerryError) else BackendError(message)
    failed = _final(pb.ModelInferResponse(id=request.id, model_name=request.model_name), True)
    return pb.ModelStreamInferResponse(error_message=message, infer_response=failed)


def _put(out: asyncio.Queue, response: pb.ModelStreamInferResponse | FerryError | None, trace, last: bool) -> None:
    """A response for the writer; a traced request's wrapped, so the writer marks its send."""
    if trace is None or isinstance(response, FerryError):
        out.put_nowait(response)
    else:
        out.put_nowait(traced.Sending(response, trace, last))


async def _decoupled(responses: AsyncIterator[pb.ModelInferResponse], request: pb.ModelInferRequest, out,
                     trace) -> None:
    async with contextlib.aclosing(responses):
        async for response in responses:
            _put(out, pb.ModelStreamInferResponse(infer_response=_final(response, False)), trace, False)
    wants = request.parameters.get("triton_enable_empty_final_response")
    if wants is not None and wants.bool_param:
        empty = pb.ModelInferResponse(id=request.id, model_name=request.model_name, model_version=request.model_version)
        _put(out, pb.ModelStreamInferResponse(infer_response=_final(empty, True)), trace, True)
    elif trace is not None:
        _put(out, None, trace, True)  # the trace ends once the responses before are written


def _final(response: pb.ModelInferResponse, final: bool) -> pb.ModelInferResponse:
    response.parameters["triton_final_response"].bool_param = final
    return response


async def _generate(registry: Registry, request: pb.ModelInferRequest, arrival: int, deadline_ns: int | None,
                    trace=None) -> AsyncIterator[tuple[pb.ModelInferResponse, bool]]:
    mv: ModelVersion = serving(registry, request.model_name, request.model_version, GENERATE)
    read = vllm_tensors.read_request(request, arrival, deadline_ns)
    observe = None
    if trace is not None:
        def observe(decoded):
            generation = GenerationTrace(trace, arrival, stream=True)
            generation.started(mv.version, request.id, decoded.sampling)
            return generation.event

    async with contextlib.aclosing(generation_tensors.answers(mv.runner, read, observe)) as answers:
        async for answer in answers:
            yield vllm_tensors.text_response(request, mv.version, answer), answer.final

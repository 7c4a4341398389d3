"""ModelInfer inside a front-end process: parse and decode here, write the tensors into the arena once,
hand a small frame to the engine, and build the reply from the answer it writes back.

Decoding errors are not answered here: they travel with the call and the engine answers them after
its model lookup, in the order one process checks (an unknown model is NOT_FOUND whatever its tensors
hold). A request that names a client's system shared memory region goes to the engine whole, over
the relay, because the regions are registered there.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc
import numpy as np

from protos import grpc_service_pb2 as pb
from server.tensors.wire import ByteSizeError
from server.tensors import shared_memory
from server.tensors import wire as tensors
from server.errors import FerryError, InvalidInputError
from server.doors.processes import messages as m
from server.ipc.arena import Allocator, Arena
from server.ipc.frames import FrameLink
from server.names import capped
from server.doors.grpc import codec
from server.doors.grpc.errors import status_of
from server.doors.grpc.response_bytes import tensor_response_bytes
from server.doors.grpc.passthrough import MalformedBodies, body_parser, serialize
from server.observability.tracing import hop

METHOD = "/inference.GRPCInferenceService/ModelInfer"
ENGINE_GONE = "the engine process of this server is gone; retry on another replica"
_SHM_KEYS = (shared_memory.REGION, shared_memory.OFFSET, shared_memory.BYTE_SIZE)


class EngineLink:
    """The front end's end of the link: calls in flight and the request half of the arena."""

    def __init__(self, arena: Arena | None, on_lost, on_stop):
        self.arena = arena
        self.requests = Allocator(0, arena.half) if arena is not None else None
        self.frames = FrameLink(self._frame, self._lost)
        self.pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._freed: list[int] = []
        self._on_lost, self._on_stop = on_lost, on_stop
        self.tracing = False  # the engine may trace calls (TRACING frames): send their trace context

    def next_id(self) -> int:
        return next(self._ids)

    def call(self, call: m.InferCall) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if self.frames.closed:  # the engine is gone; this process is on its way out
            future.set_result((m.ERROR, call.rid, "UNAVAILABLE", ENGINE_GONE))
            return future
        self.pending[call.rid] = future
        self.frames.send((m.INFER, tuple(call)))
        return future

    def cancel(self, rid: int) -> None:
        if self.pending.pop(rid, None) is not None:
            self.frames.send((m.CANCEL, rid))

    def release(self, tensors_: list[m.Tensor]) -> None:
        """Answer-half blocks the reply has been copied out of."""
        offsets = [t.offset for t in tensors_ if t.offset is not None]
        if offsets:
            self.frames.send((m.FREE, offsets))

    def _frame(self, frame: tuple) -> None:
        kind = frame[0]
        if kind == m.FREE:
            for offset in frame[1]:
                self.requests.free(offset)
            return
        if kind == m.STOP:
            self._on_stop(frame[1])
            return
        if kind == m.TRACING:
            self.tracing = frame[1]
            return
        future = self.pending.pop(frame[1], None)
        if future is not None and not future.done():
            future.set_result(frame)
        elif kind == m.DONE or kind == m.TRACED:  # its caller left meanwhile: the blocks still go back
            self.release(frame[3])
            if kind == m.TRACED:  # its trace ends without a send
                self.frames.send((m.SENT, frame[1], None, None))

    def traced(self, rid: int, context) -> None:
        """A traced answer is handed to gRPC now; its send's end (the call is over) goes to the engine."""
        start = time.monotonic_ns()
        context.add_done_callback(lambda _: self.frames.send((m.SENT, rid, start, time.monotonic_ns())))

    def _lost(self, exc) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_result((m.ERROR, 0, "UNAVAILABLE", ENGINE_GONE))
        self.pending.clear()
        self._on_lost()

    def place(self, name: str, datatype: str, shape: tuple, data) -> m.Tensor:
        """A tensor's raw bytes, in the arena when they fit, else inline."""
        nbytes = data.nbytes if hasattr(data, "nbytes") else len(data)
        offset = self.requests.allocate(nbytes) if self.requests is not None and nbytes else None
        if offset is None:
            return m.Tensor(name, datatype, shape, nbytes, None, data if isinstance(data, bytes) else data.tobytes())
        if isinstance(data, bytes):
            self.arena.view[offset : offset + nbytes] = data
        else:  # any dtype, bf16 included, as bytes: straight from the decoded array into the arena
            np.frombuffer(self.arena.mapping, np.uint8, nbytes, offset)[:] = data.reshape(-1).view(np.uint8)
        return m.Tensor(name, datatype, shape, nbytes, offset)


class FrontInfer:
    """The ModelInfer handler of a front-end process; `relay` serves what must reach the engine whole."""

    def __init__(self, link: EngineLink, relay, bodies: MalformedBodies):
        self.link, self.relay = link, relay
        self.parse = body_parser(pb.ModelInferRequest, "inference.GRPCInferenceService/ModelInfer", bodies)

    def handler(self) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(self.infer, request_deserializer=None, response_serializer=serialize)

    async def infer(self, raw: bytes, context):
        arrival = time.monotonic_ns()
        remaining = context.time_remaining()
        try:
            request = self.parse(raw)
        except InvalidInputError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        if _names_regions(request):
            return await self.relay.unary(METHOD, raw, context)
        rid = self.link.next_id()
        future = self.link.call(self._call(rid, request, arrival, remaining, context))
        try:
            reply = await future
        except asyncio.CancelledError:
            self.link.cancel(rid)  # the engine's task is cancelled too: its runner drops the request
            raise
        if reply[0] == m.ERROR:
            await context.abort(grpc.StatusCode[reply[2]], reply[3])
        response = self._response(request, reply[2], reply[3], reply[4])
        if reply[0] == m.TRACED:
            self.link.traced(rid, context)
        return response

    def _call(self, rid: int, request: pb.ModelInferRequest, arrival: int, remaining: float | None,
              context) -> m.InferCall:
        inputs, params, input_error, sent = {}, {}, None, []
        try:
            inputs = codec.decode_inputs(request)
            params = codec.decode_parameters(request.parameters)
        except FerryError as exc:
            if isinstance(exc, ByteSizeError):  # Triton's words name the model, as one process says them
                exc = exc.for_model(request.model_name)
            input_error, inputs = (status_of(exc).name, capped(exc.message)), {}
        wanted, output_error = [], None
        for output in request.outputs:
            if "classification" in output.parameters:
                try:
                    wanted.append((output.name, codec.decode_parameters(output.parameters)))
                except FerryError as exc:
                    output_error = (status_of(exc).name, capped(exc.message))
                    break
        if input_error is None:
            sent = [self._place(t, inputs[t.name]) for t in request.inputs]
        nbytes = (sum(map(len, request.raw_input_contents)) if request.raw_input_contents
                  else sum(a.nbytes for a in inputs.values()))
        return m.InferCall(rid, request.model_name, request.model_version, request.id, sent, params,
                           tuple(o.name for o in request.outputs), tuple(wanted), arrival, remaining, nbytes,
                           input_error, output_error, hop.carrier(context) if self.link.tracing else None)

    def _place(self, tensor, array) -> m.Tensor:
        data = tensors.to_raw(array) if array.dtype == object else array
        return self.link.place(tensor.name, tensor.datatype, tuple(array.shape), data)

    def _response(self, request: pb.ModelInferRequest, version: int, outputs: list[m.Tensor],
                  params: dict) -> pb.ModelInferResponse | bytes:
        """The reply, its tensors copied once out of the arena: as bytes (response_bytes.py), or as a message
        when the model set response parameters."""
        view = self.link.arena.view if self.link.arena is not None else None
        raws = [t.data if t.offset is None else view[t.offset : t.offset + t.nbytes] for t in outputs]
        if params:
            response = pb.ModelInferResponse(model_name=request.model_name, model_version=str(version), id=request.id)
            for key, value in params.items():  # the model's response parameters (Triton's Python API)
                codec.set_parameter(response.parameters[key], value)
            for t, raw in zip(outputs, raws):
                response.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
                response.raw_output_contents.append(bytes(raw))
        else:
            response = tensor_response_bytes(request.model_name, request.id, version,
                                             tuple((t.name, t.datatype, tuple(t.shape)) for t in outputs), raws)
        del raws  # no view of the arena outlives the copy: its blocks are handed back next
        self.link.release(outputs)
        return response


def _names_regions(request: pb.ModelInferRequest) -> bool:
    return any(key in t.parameters for t in (*request.inputs, *request.outputs) for key in _SHM_KEYS)


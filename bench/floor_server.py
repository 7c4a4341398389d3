"""The Python gRPC floor: a bare grpc.aio ModelInfer handler with no scheduling at all.

It decodes the input into a numpy view and answers a fixed 16-float output: the most requests per
second any Python server can answer on this machine, the ceiling Ferry's light-model figure is
measured against. It runs on the event loop Ferry runs on by default (server/event_loop.py), with the
cycle collector set as Ferry sets it (server/heap.py), and registers its handler the way Ferry does, so
the floor is as low as Ferry's own loop, collector and gRPC allow.

    python -m bench.floor_server [PORT] [--batched [--model MODEL.onnx]]

`--batched`: each request waits for an answer handed back from a worker thread, one hand-back for all
the requests that queued while the thread was busy: the hop any batching server makes (a future per
request, a thread, one call_soon_threadsafe per batch), with nothing else. bench/hotpath.py runs it
beside the plain floor to tell that hop's cost from the rest of Ferry's.

`--model`: the batching hop's thread also runs that ONNX model (one input, one output, rows stacked with
np.concatenate, the session set up as Ferry sets up its own) and answers each request its row: the
smallest batching server that does the work Ferry does, so the CPU the model takes from a small machine's
event loop and clients is counted on both sides.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
from pathlib import Path

import grpc
import numpy as np

from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from server import event_loop, heap


class Floor(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self):
        self.output = np.zeros((1, 16), np.float32).tobytes()

    async def ModelInfer(self, request, context):
        return _response(request, "y", _rows(request).shape[0], 16, self.output)


class BatchedFloor(Floor):
    """The floor behind a batching hop: requests queue while the worker thread holds a batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__()
        self.loop = loop
        self.queued: list[asyncio.Future] = []
        self.busy = False
        self.batches: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._worker, daemon=True).start()

    def _worker(self) -> None:
        while True:
            batch = self.batches.get()
            self.loop.call_soon_threadsafe(self._answer, batch, [self.output] * len(batch))

    def _answer(self, futures: list[asyncio.Future], answers: list[bytes]) -> None:
        for future, answer in zip(futures, answers):
            if not future.done():
                future.set_result(answer)
        self.busy = False
        self._dispatch()

    def _dispatch(self) -> None:
        if self.queued and not self.busy:
            self.busy = True
            batch, self.queued = self.queued, []
            self.batches.put(batch)

    async def ModelInfer(self, request, context):
        future = self.loop.create_future()
        self.queued.append(future)
        self._dispatch()
        await future
        return await super().ModelInfer(request, context)


class ModelFloor(BatchedFloor):
    """The batching hop whose thread runs the model on each batch's stacked rows."""

    def __init__(self, loop: asyncio.AbstractEventLoop, model: Path):
        import onnxruntime as ort

        options = ort.SessionOptions()  # as server/backends/onnx_runtime.py sets it by default
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name
        self.output_name = self.session.get_outputs()[0].name
        self.rows = self.batches_run = 0  # its ModelStatistics: the mean batch it forms, beside Ferry's
        super().__init__(loop)

    def _worker(self) -> None:
        while True:
            batch = self.batches.get()
            rows = np.concatenate([x for _, x in batch])
            y = self.session.run(None, {self.input: rows})[0]
            self.rows += len(rows)
            self.batches_run += 1
            self.loop.call_soon_threadsafe(self._answer, [f for f, _ in batch], split_rows(y, [x for _, x in batch]))

    async def ModelInfer(self, request, context):
        x = _rows(request)
        future = self.loop.create_future()
        self.queued.append((future, x))
        self._dispatch()
        y = await future
        return _response(request, self.output_name, x.shape[0], len(y) // 4 // x.shape[0], y)

    async def ModelStatistics(self, request, context):
        stats = pb.ModelStatisticsResponse()
        stats.model_stats.add(name=request.name, version="1", inference_count=self.rows, execution_count=self.batches_run)
        return stats


def _rows(request: pb.ModelInferRequest) -> np.ndarray:
    """The request's one FP32 input, a view over its raw bytes."""
    return np.frombuffer(request.raw_input_contents[0], np.float32).reshape(tuple(request.inputs[0].shape))


def _response(request: pb.ModelInferRequest, name: str, rows: int, width: int, data: bytes) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
    response.outputs.add(name=name, datatype="FP32", shape=[rows, width])
    response.raw_output_contents.append(data)
    return response


def split_rows(y: np.ndarray, parts: list[np.ndarray]) -> list[bytes]:
    """The rows of a batch's output that answer each of its parts, in order."""
    return [rows.tobytes() for rows in np.split(y, np.cumsum([len(x) for x in parts])[:-1])]


async def main(port: int, batched: bool, model: Path | None) -> None:
    server = grpc.aio.server()
    loop = asyncio.get_running_loop()
    floor = (ModelFloor(loop, model) if model else BatchedFloor(loop)) if batched else Floor()
    # A generic handler only, as Ferry registers its services (server/doors/grpc/gates.py): grpc.aio waits
    # on every *registered* method's pending call for each call it accepts, which costs a floor as much.
    handler = grpc.unary_unary_rpc_method_handler(floor.ModelInfer, request_deserializer=pb.ModelInferRequest.FromString,
                                                  response_serializer=pb.ModelInferResponse.SerializeToString)
    methods = {"ModelInfer": handler}
    if model:
        methods["ModelStatistics"] = grpc.unary_unary_rpc_method_handler(
            floor.ModelStatistics, request_deserializer=pb.ModelStatisticsRequest.FromString,
            response_serializer=pb.ModelStatisticsResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("inference.GRPCInferenceService", methods),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    heap.park()  # the collector's settings Ferry serves with (server/heap.py): its savings are the floor's too
    print(f"ferry: serving gRPC on 127.0.0.1:{bound}\nferry: ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    argv = sys.argv[1:]
    numbers = [a for a in argv if a.isdigit()]
    model_path = Path(argv[argv.index("--model") + 1]) if "--model" in argv else None
    event_loop.run(main(int(numbers[0]) if numbers else 0, "--batched" in argv or model_path is not None, model_path))

"""The Python gRPC floor: a bare grpc.aio ModelInfer handler with no scheduling at all.

It decodes the input into a numpy view and answers a fixed 16-float output: the most requests per
second any Python server can answer on this machine, the ceiling Ferry's light-model figure is
measured against. It runs on the event loop Ferry runs on by default (server/event_loop.py), so the
floor is as low as Ferry's own loop allows.
"""

from __future__ import annotations

import sys

import grpc
import numpy as np

from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from server import event_loop


class Floor(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self):
        self.output = np.zeros((1, 16), np.float32).tobytes()

    async def ModelInfer(self, request, context):
        x = np.frombuffer(request.raw_input_contents[0], np.float32).reshape(tuple(request.inputs[0].shape))
        response = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        response.outputs.add(name="y", datatype="FP32", shape=[x.shape[0], 16])
        response.raw_output_contents.append(self.output)
        return response


async def main(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Floor(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"ferry: serving gRPC on 127.0.0.1:{bound}\nferry: ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    event_loop.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))

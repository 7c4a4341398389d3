"""The gRPC gates (server/doors/grpc/gates.py) on a real grpc.aio server: drain and access decided where gRPC looks
each method up, in interceptor order (the access refusal wins over the drain's, as when both were interceptors),
probes passing a closed drain and needing no token, unknown methods still UNIMPLEMENTED (and, as before, counted
as refused while draining)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from server.doors.access import AccessPolicy
from server.doors.grpc.auth import AccessCheck
from server.doors.grpc.drain import DrainGate
from server.doors.grpc.gates import ServiceHandlers, serve_behind
from server.doors.tokens import Tokens


class Live(pb_grpc.GRPCInferenceServiceServicer):
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)


async def _codes(drain_closed: bool, token: bytes | None) -> dict[str, grpc.StatusCode]:
    server = grpc.aio.server()
    services = ServiceHandlers()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Live(), services)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, services)
    assert services.handlers and len(services.handlers) == 2
    gate = DrainGate()
    access = AccessCheck(AccessPolicy(Tokens(inference=(b"good",)), {}))
    serve_behind(server, services, [access, gate])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    if drain_closed:
        gate.close()
    metadata = (("authorization", f"Bearer {token.decode()}"),) if token else ()
    codes = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            calls = {
                "live": lambda: pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), metadata=metadata),
                "metadata": lambda: pb_grpc.GRPCInferenceServiceStub(channel).ServerMetadata(pb.ServerMetadataRequest(),
                                                                                             metadata=metadata),
                "health": lambda: health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), metadata=metadata),
                "unknown": lambda: channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")(b"", metadata=metadata),
            }
            for name, call in calls.items():
                try:
                    await call()
                    codes[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    codes[name] = exc.code()
    finally:
        await server.stop(0)
    codes["refused"] = gate.refused
    return codes


@pytest.mark.parametrize("closed, token, expected", [
    (False, b"good", {"live": grpc.StatusCode.OK, "metadata": grpc.StatusCode.UNIMPLEMENTED,
                      "health": grpc.StatusCode.OK, "unknown": grpc.StatusCode.UNIMPLEMENTED, "refused": 0}),
    (True, b"good", {"live": grpc.StatusCode.OK, "metadata": grpc.StatusCode.UNAVAILABLE,
                     "health": grpc.StatusCode.OK, "unknown": grpc.StatusCode.UNIMPLEMENTED, "refused": 2}),
    (True, None, {"live": grpc.StatusCode.OK, "metadata": grpc.StatusCode.UNAUTHENTICATED,
                  "health": grpc.StatusCode.OK, "unknown": grpc.StatusCode.UNIMPLEMENTED, "refused": 2}),
])
def test_gates_decide_each_call_in_interceptor_order(closed, token, expected):
    assert asyncio.run(asyncio.wait_for(_codes(closed, token), 60)) == expected

"""The gRPC drain gate: once the server is shutting down, new calls are refused UNAVAILABLE at once.

grpc.aio's `stop()` cancels every call it has received but not yet handed to a handler, and clients
(and their retry policies) treat CANCELLED as final. So on SIGTERM the server keeps running behind
this gate: new calls get UNAVAILABLE, which balancers and retry policies move to another replica,
while admitted work drains; gRPC is stopped only after that. Probes stay answerable, so a balancer
can read NOT_SERVING and a liveness probe does not kill a draining server. The state (closed, refusals,
quiet) is server/doors/drain.py's, shared with the HTTP door.
"""

from __future__ import annotations

import grpc

from server.doors.drain import SHUTTING_DOWN, Drain
from server.doors.grpc.refusal import refusal

PROBES = frozenset({
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
})


class DrainGate(Drain):
    """A gate (server/doors/grpc/gates.py): applied where gRPC looks each call's method up."""

    def gate(self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
        if self.closed and details.method not in PROBES:
            self.refuse()
            return refusal(handler, grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        return handler

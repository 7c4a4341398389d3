"""The drain gate: once the server is shutting down, new calls are refused UNAVAILABLE at once.

grpc.aio's `stop()` cancels every call it has received but not yet handed to a handler, and clients
(and their retry policies) treat CANCELLED as final. So on SIGTERM the server keeps running behind
this gate: new calls get UNAVAILABLE, which balancers and retry policies move to another replica,
while admitted work drains; gRPC is stopped only after that. Probes stay answerable, so a balancer
can read NOT_SERVING and a liveness probe does not kill a draining server.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from server.rpc.refusal import refusal

PROBES = frozenset({
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
})
SHUTTING_DOWN = "server is shutting down; retry on another replica"


class DrainGate(grpc.aio.ServerInterceptor):
    def __init__(self):
        self.closed = False
        self._last_refused = 0.0  # time.monotonic() of the latest refused call
        self.refused = 0  # calls refused while draining, for the log

    def close(self) -> None:
        """From now on every call but a probe is answered UNAVAILABLE."""
        self.closed = True
        self._last_refused = time.monotonic()

    async def quiet(self, quiet_s: float, timeout_s: float) -> bool:
        """Wait until no call has been refused for `quiet_s` (clients have moved away), at most `timeout_s`.

        `stop()` cancels calls that reach gRPC while it stops, so it is called once callers have left:
        clients that watch grpc.health.v1 (a `healthCheckConfig` in their service config) leave as soon as
        they read NOT_SERVING; others keep arriving and are refused until the grace runs out."""
        deadline = time.monotonic() + timeout_s
        while (now := time.monotonic()) < deadline:
            idle = now - self._last_refused
            if idle >= quiet_s:
                return True
            await asyncio.sleep(min(quiet_s - idle, deadline - now))
        return False

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if self.closed and details.method not in PROBES:
            self._last_refused = time.monotonic()
            self.refused += 1
            return refusal(handler, grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        return handler

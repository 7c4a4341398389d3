"""Bearer-token authentication for gRPC: the metadata's `authorization` checked by server/tokens.py.

Off unless a token is configured. Tokens travel in the `authorization: Bearer <token>` metadata that
tritonclient sends with `headers=`. Probes stay open so load balancers and orchestrators need no secret.
"""

from __future__ import annotations

import grpc

from server.rpc.drain import PROBES
from server.rpc.refusal import refusal
from server.tokens import UNAUTHENTICATED, Tokens, authorize, read_tokens

__all__ = ["CONTROL", "TokenAuth", "Tokens", "read_tokens"]

CONTROL = frozenset({
    "/inference.GRPCInferenceService/RepositoryModelLoad",
    "/inference.GRPCInferenceService/RepositoryModelUnload",
    "/inference.GRPCInferenceService/LogSettings",
})


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: Tokens):
        self.tokens = tokens

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if details.method in PROBES:
            return handler
        value = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        denial = authorize(self.tokens, value, details.method in CONTROL)
        if denial is None:
            return handler
        code = grpc.StatusCode.UNAUTHENTICATED if denial.kind == UNAUTHENTICATED else grpc.StatusCode.PERMISSION_DENIED
        return refusal(handler, code, denial.message)

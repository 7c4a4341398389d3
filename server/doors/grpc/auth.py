"""The gRPC side of server/doors/access.py: each call's method looked up in the one table, its metadata checked.

Off unless tokens or restricted categories are configured. Tokens travel in the `authorization:
Bearer <token>` metadata that tritonclient sends with `headers=`; a restricted category's key in
`triton-grpc-protocol-<key>`, as Triton reads it.
"""

from __future__ import annotations

import grpc

from server.doors.access import RESTRICTED, AccessPolicy, grpc_operation
from server.doors.grpc.refusal import refusal
from server.doors.tokens import UNAUTHENTICATED

# Triton answers a missing restricted header UNAVAILABLE; Ferry says PERMISSION_DENIED with Triton's
# words, so clients that match the text still do and retry policies do not retry a refusal.
_CODES = {UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED, RESTRICTED: grpc.StatusCode.PERMISSION_DENIED}


class AccessCheck:
    """A gate (server/doors/grpc/gates.py): applied where gRPC looks each call's method up."""

    def __init__(self, policy: AccessPolicy):
        self.policy = policy

    def gate(self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
        metadata = details.invocation_metadata or ()
        denial = self.policy.check(grpc_operation(details.method),
                                   lambda key: next((v for k, v in metadata if k == key), None))
        if denial is None:
            return handler
        return refusal(handler, _CODES.get(denial.kind, grpc.StatusCode.PERMISSION_DENIED), denial.message)

"""Bearer-token authentication and the two rights it grants: inference, and model control (admin).

Off unless a token is configured. Tokens travel in the `authorization: Bearer <token>` metadata that
tritonclient sends with `headers=`; they are compared with hmac.compare_digest so the time taken does
not reveal how much of a guess was right. Probes stay open so load balancers and orchestrators need no
secret. Model control needs the admin token: with only inference tokens configured, load and unload
are refused, so a leaked inference token can never change what the server serves.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

from server.rpc.drain import PROBES
from server.rpc.refusal import refusal

CONTROL = frozenset({
    "/inference.GRPCInferenceService/RepositoryModelLoad",
    "/inference.GRPCInferenceService/RepositoryModelUnload",
})


@dataclass(frozen=True, slots=True)
class Tokens:
    inference: tuple[bytes, ...] = ()  # grant inference, metadata, statistics, reflection, generation
    admin: tuple[bytes, ...] = ()  # grant all of that plus model control

    @property
    def enabled(self) -> bool:
        return bool(self.inference or self.admin)


def read_tokens(path: Path | None, env_value: str | None) -> tuple[bytes, ...]:
    """Tokens from a file (one a line; blank lines and `#` comments skipped) and an environment value."""
    lines = path.read_text().splitlines() if path is not None else []
    lines += (env_value or "").split(",")
    return tuple(t.strip().encode() for t in lines if t.strip() and not t.strip().startswith("#"))


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: Tokens):
        self.tokens = tokens

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if details.method in PROBES:
            return handler
        token = _bearer(details.invocation_metadata)
        if token is None:
            return refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                           "this server requires a token: send metadata 'authorization: Bearer <token>'")
        admin = _matches(token, self.tokens.admin)
        if not admin and not _matches(token, self.tokens.inference):
            return refusal(handler, grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not valid for this server")
        if details.method in CONTROL and not admin:
            return refusal(handler, grpc.StatusCode.PERMISSION_DENIED,
                           "loading and unloading models needs the admin token (--admin-token-file)")
        return handler


def _bearer(metadata) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            value = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip().encode()
    return None


def _matches(token: bytes, accepted: tuple[bytes, ...]) -> bool:
    found = False
    for candidate in accepted:  # every candidate is compared, so timing does not tell which one matched
        found |= hmac.compare_digest(token, candidate)
    return found

"""One exception for every failed call, carrying the gRPC status and the server's message."""

from __future__ import annotations

import grpc


class FerryClientError(Exception):
    """A call failed: `status` is the gRPC status code, `message` the server's (or gRPC's) explanation."""

    def __init__(self, status: grpc.StatusCode, message: str):
        super().__init__(status, message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return f"{self.status.name}: {self.message}"

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> FerryClientError:
        # Sync and asyncio errors both expose code() and details(); a failed connection has no details.
        code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")

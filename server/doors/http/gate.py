"""The ASGI layer every HTTP call passes first: drain refusal, access checks, request counts.

The same decisions as gRPC's gates (doors/grpc/gates.py), from the same objects: the server's `Drain` (503 while
draining, counted so the app knows when callers have gone) and the one access table of
server/doors/access.py (401 without a valid token, 403 for a call the token may not make or a restricted
category without its header). Probes stay open to tokens and drain, as over gRPC. Plain ASGI rather
than Starlette's BaseHTTPMiddleware, which would buffer streamed answers.
"""

from __future__ import annotations

import json

from server.doors.access import HTTP_PROBES, AccessPolicy, http_operation
from server.doors.drain import SHUTTING_DOWN, Drain
from server.doors.tokens import UNAUTHENTICATED


class Gate:
    def __init__(self, app, drain: Drain, access: AccessPolicy, counter):
        self.app, self.drain, self.access, self.counter = app, drain, access, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {}

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is None:
                await self.app(scope, receive, counted_send)
            else:
                await _respond(scope, counted_send, *refusal)
        finally:
            endpoint = getattr(scope.get("endpoint"), "__name__", "unmatched") if refusal is None else "refused"
            self.counter.labels(endpoint, str(status.get("code", 499))).inc()  # 499: the client left first

    def _refusal(self, scope) -> tuple[int, str] | None:
        path = scope["path"]
        operation = http_operation(path)
        if self.access.enabled:
            headers = scope["headers"]
            denial = self.access.check(operation, lambda key: next((v for k, v in headers if k == key.encode()), None))
            if denial is not None:
                return (401 if denial.kind == UNAUTHENTICATED else 403), denial.message
        if path in HTTP_PROBES:
            return None
        if self.drain.closed:
            self.drain.refuse()
            return 503, SHUTTING_DOWN
        return None


async def _respond(scope, send, status: int, message: str) -> None:
    """KServe's error body on /v2, OpenAI's on /v1, so each door's clients read the reason their own way."""
    if scope["path"].startswith("/v1/"):
        kind = {401: "authentication_error", 403: "permission_error"}.get(status, "service_unavailable")
        body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    else:
        body = {"error": message}
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})

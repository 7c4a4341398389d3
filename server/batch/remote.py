"""The same lines sent to a running Ferry server (`ferry batch --url`): over its HTTP door, or its gRPC door.

HTTP: aiohttp keeps a pool of keep-alive connections no larger than the number of requests in flight.
gRPC (`grpc://HOST:PORT`, or a bare HOST:PORT as tritonclient takes it): the HTTP door's gRPC upstream
reads each body with the door's readers, sends ModelInfer or Generate on one channel, and writes the
answer with the door's encoders, so a line's answer is the one the HTTP API gives. A request that got
no answer at all (connection refused or reset, a refused token) raises `Unanswered`: its line is not
written, so a rerun sends it again.
"""

from __future__ import annotations

import aiohttp

from server.batch.run import Unanswered
from server.doors.http.grpc_upstream import GrpcUpstream, NoAnswer, problem

GRPC_SCHEMES = ("grpc://", "grpcs://")


def grpc_target(url: str) -> tuple[str, bool] | None:
    """(HOST:PORT, TLS) when `url` names a gRPC door; None for an HTTP one."""
    for scheme in GRPC_SCHEMES:
        if url.startswith(scheme):
            return url[len(scheme):].rstrip("/"), scheme == "grpcs://"
    return None if "://" in url else (url.rstrip("/"), False)


def grpc_problem(url: str, body: dict) -> str | None:
    """Why a line cannot go over gRPC (checked with the file, before anything runs)."""
    return problem(url, body)


class RemoteServer:
    def __init__(self, url: str, connections: int, token: str | None = None, timeout_s: float | None = None):
        self.url = url.rstrip("/")
        self.connections, self.timeout_s = connections, timeout_s
        self.headers = {"content-type": "application/json"}
        if token:
            self.headers["authorization"] = f"Bearer {token}"
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RemoteServer:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.connections),
                                             timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self

    async def post(self, path: str, body: bytes) -> tuple[int, bytes, bool]:
        try:
            async with self.session.post(self.url + path, data=body, headers=self.headers) as response:
                return response.status, await response.read(), False  # another process's bytes: parsed
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unanswered(f"{type(exc).__name__}: {exc}") from None

    async def __aexit__(self, *exc) -> None:
        await self.session.close()


class GrpcServer:
    def __init__(self, target: str, secure: bool, token: str | None = None, timeout_s: float | None = None):
        self.upstream = GrpcUpstream(target, token, timeout_s, secure)

    async def __aenter__(self) -> GrpcServer:
        await self.upstream.__aenter__()
        return self

    async def post(self, path: str, body: bytes) -> tuple[int, bytes, bool]:
        try:
            status, answer, media = await self.upstream.post(path, body)
            return status, answer, media == "application/json"  # encoded here, by the HTTP door's encoders
        except NoAnswer as exc:
            raise Unanswered(str(exc)) from None

    async def __aexit__(self, *exc) -> None:
        await self.upstream.__aexit__(*exc)

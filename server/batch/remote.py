"""The same lines sent to a running Ferry server over its HTTP door (`ferry batch --url`).

aiohttp keeps a pool of keep-alive connections no larger than the number of requests in flight.
A request that got no HTTP answer at all (connection refused or reset) raises `Unanswered`: its
line is not written, so a rerun sends it again.
"""

from __future__ import annotations

import aiohttp

from server.batch.run import Unanswered


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

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        try:
            async with self.session.post(self.url + path, data=body, headers=self.headers) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unanswered(f"{type(exc).__name__}: {exc}") from None

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

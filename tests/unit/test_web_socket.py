"""The HTTP front door's listening socket: connections it accepts must have Nagle off.

With Nagle on, an answer uvicorn writes in two parts (headers, then body) on a keep-alive connection
waits for the client's delayed ACK: ~40 ms per request (bench/http_vs_grpc.py found it as 24 req/s at
concurrency 1). asyncio sets TCP_NODELAY only on accepted sockets whose `proto` is IPPROTO_TCP, which
`socket.create_server` leaves 0, so the check is made on a real accepted connection.
"""

from __future__ import annotations

import asyncio
import socket

from server.doors.http.server import listening_socket


async def _accepted_nodelay(sock: socket.socket) -> int:
    loop = asyncio.get_running_loop()
    accepted = loop.create_future()

    class Protocol(asyncio.Protocol):
        def connection_made(self, transport):
            accepted.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    server = await loop.create_server(Protocol, sock=sock)
    _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
    try:
        return await asyncio.wait_for(accepted, 30)
    finally:
        writer.close()
        server.close()


def test_accepted_connections_have_nagle_off():
    sock = listening_socket("127.0.0.1", 0)
    assert sock.getsockname()[1] > 0
    assert asyncio.run(_accepted_nodelay(sock)) == 1

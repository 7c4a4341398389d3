"""One HTTP exchange with an ASGI app held in memory: no socket, no HTTP parsing.

The request is a complete body; the answer is collected whole. After the answer is sent, the
app's `receive` reports a disconnect, as a server does once the client has read the response, so
a handler that watches for the client leaving (streamed answers) ends instead of waiting forever.
"""

from __future__ import annotations

import asyncio


async def call(app, method: str, path: str, body: bytes,
               headers: tuple[tuple[bytes, bytes], ...] = ((b"content-type", b"application/json"),)) -> tuple[int, bytes, str]:
    """Send one request to `app`; returns the status code, the whole response body and its content type."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [*headers, (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 0), "server": ("ferry-batch", 0)}
    answered = asyncio.Event()
    status, chunks, media = [500], [], [""]
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            status[0] = message["status"]
            media[0] = next((v.decode("latin-1") for k, v in message.get("headers", ()) if k == b"content-type"), "")
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                answered.set()

    await app(scope, receive, send)
    answered.set()
    return status[0], b"".join(chunks), media[0]

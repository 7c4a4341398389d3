"""The model repository served inside this process, reached through the HTTP door's own app.

The engine is built as `ferry serve` builds it (server/engine.py) and every line goes through the
Starlette app of server/doors/http/ in memory (asgi.py), behind the same gate, so its answer is the HTTP
API's, byte for byte: no second encoder, and no socket is opened.
"""

from __future__ import annotations

import logging
from pathlib import Path

from server.doors.access import AccessPolicy, restriction_table
from server.app import ServerConfig, ServerHealth
from server import heap
from server.batch import asgi
from server.doors.drain import Drain
from server.engine import build_engine
from server.observability.log_settings import LogControl
from server.observability.metrics import FrontDoorRequests
from server.doors.model_control import ModelControl
from server.repository.registry import READY
from server.doors.tokens import Tokens
from server.doors.http.server import WebOptions, build_app

log = logging.getLogger("ferry.batch")
CLOSE_GRACE_S = 30.0


class LocalEngine:
    """`async with LocalEngine(repo) as engine: status, body, trusted = await engine.post(path, body)`."""

    def __init__(self, repository: Path, **config):
        self.config = ServerConfig(model_repository=repository, metrics_port=None, web=None, **config)
        self.engine = None
        self.app = None

    async def __aenter__(self) -> LocalEngine:
        heap.keep()  # before any model allocates: big steps' tensors reuse the heap (server/heap.py)
        self.engine = build_engine(self.config)
        registry = self.engine.registry
        await self.engine.load(self.config)
        for row in registry.index():
            (log.info if row.state == READY else log.warning)("model %-24s %-11s %s", row.name, row.state, row.reason)
        for version in registry.all_versions():
            offline = getattr(version.runner, "throughput_first", None)  # generation runners: no step-time target
            if offline is not None:
                offline()
        options = WebOptions()
        self.app = build_app(registry, ServerHealth(ready=True), Drain(), AccessPolicy(Tokens(), restriction_table([])),
                             FrontDoorRequests(self.engine.prom).http, options, LogControl(allow_updates=False),
                             ModelControl(registry))
        return self

    async def post(self, path: str, body: bytes) -> tuple[int, bytes, bool]:
        status, answer, media = await asgi.call(self.app, "POST", path, body)
        return status, answer, media == "application/json"  # the door's own JSON: written into OUTPUT as it is

    async def __aexit__(self, exc_type, *exc) -> None:
        await self.engine.close(0.0 if exc_type is not None else CLOSE_GRACE_S)  # interrupted: cut off at once


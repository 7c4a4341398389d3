"""The HTTP server: a Starlette app on uvicorn, inside the event loop gRPC and the runners use.

uvicorn brings the HTTP/1.1 parsing (httptools, llhttp) and keep-alive; Starlette the routing and
streamed responses that notice a client leaving. uvicorn is driven through its startup / main_loop /
shutdown steps rather than `serve()`, which would install its own SIGINT/SIGTERM handlers over the
app's drain. The socket is bound here, so port 0 gives a real port before anything is printed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

import uvicorn
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from server.doors.access import AccessPolicy
from server.doors.drain import Drain
from server.observability.log_settings import LogControl
from server.observability.metrics import FrontDoorRequests
from server.doors.model_control import ModelControl
from server.repository.registry import Registry
from server.tensors.shared_memory import SharedMemoryRegistry
from server.observability.tracing.control import TraceControl
from server.doors.http.gate import Gate
from server.doors.http.generate import GenerateRoutes
from server.doors.http.kserve import KServeRoutes
from server.doors.http.lora_api import LoraRoutes
from server.doors.http.openai_api import OpenAIRoutes
from server.doors.http.probes import ProbeRoutes
from server.doors.http.shared_memory import SharedMemoryRoutes
from server.doors.header_forward import header_forward
from server.doors.ports import claiming

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WebOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    body_limit: int = 2**31 - 1  # bytes, as gRPC's message limit
    header_forward: str | None = None  # --http-header-forward-pattern: headers made request parameters


def build_app(registry: Registry, health, drain: Drain, access: AccessPolicy, counter, options: WebOptions,
              logs: LogControl, control: ModelControl, server_name: str = "ferry",
              regions: SharedMemoryRegistry | None = None, tracing: TraceControl | None = None,
              metrics: CollectorRegistry | None = None):
    """`regions`: the system shared memory regions, the same registry the gRPC door serves (one set per server);
    `metrics`: the Prometheus registry, also served on /metrics here as vLLM does."""
    regions = regions if regions is not None else SharedMemoryRegistry()
    routes = (KServeRoutes(registry, health, options.body_limit, logs, control, server_name, regions, tracing,
                           header_forward(options.header_forward)).routes()
              + SharedMemoryRoutes(regions, options.body_limit).routes()
              + GenerateRoutes(registry, options.body_limit, tracing).routes()
              + OpenAIRoutes(registry, options.body_limit, tracing).routes()
              + LoraRoutes(registry, options.body_limit, control).routes()
              + ProbeRoutes(health, metrics).routes())
    return Gate(Starlette(routes=routes), drain, access, counter)


class WebServer:
    def __init__(self, options: WebOptions, registry: Registry, health, drain: Drain, access: AccessPolicy,
                 requests: FrontDoorRequests, logs: LogControl, control: ModelControl, server_name: str = "ferry",
                 regions: SharedMemoryRegistry | None = None, tracing: TraceControl | None = None,
                 metrics: CollectorRegistry | None = None):
        app = build_app(registry, health, drain, access, requests.http, options, logs, control, server_name, regions,
                        tracing, metrics)
        self.config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                     http="httptools", timeout_keep_alive=30)
        self.server = uvicorn.Server(self.config)
        self.options = options
        self.host, self.port = options.host, options.port
        self._socket: socket.socket | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        with claiming("HTTP", self.options.host, self.options.port):
            self._socket = listening_socket(self.options.host, self.options.port)
        self.port = self._socket.getsockname()[1]
        self.config.load()
        self.server.lifespan = self.config.lifespan_class(self.config)
        await self.server.startup(sockets=[self._socket])
        self._task = asyncio.get_running_loop().create_task(self.server.main_loop(), name="http")

    async def stop(self, grace_s: float) -> None:
        """Stop listening, let open calls finish within `grace_s`, then close every connection."""
        if self._task is None:
            return
        self.server.should_exit = True
        self.config.timeout_graceful_shutdown = max(grace_s, 0.1)
        await self._task
        await self.server.shutdown(sockets=[self._socket])


def listening_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket whose protocol is stated (IPPROTO_TCP), not left 0 as `socket.create_server`
    leaves it: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets whose `proto` says TCP, and
    with Nagle on, a keep-alive answer written in two parts (headers, then body) waits for the client's
    delayed ACK, about 40 ms per request on Linux."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


"""Wiring: registry(runner factory, drain grace) -> front doors (gRPC, HTTP) -> metrics endpoint; ordered start and drain."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field, replace
from pathlib import Path

from prometheus_client import CollectorRegistry

from server import heap
from server.defaults import DEFAULT_MAX_BATCH_SIZE, DRAIN_GRACE_S, MAX_QUEUED_REQUESTS
from server.engine import build_engine
from server.doors.ports import PortUnavailable, claiming
from server.event_loop import AUTO as AUTO_LOOP
from server.event_loop import name as loop_name
from server.observability.exposition import MetricsServer
from server.doors.processes.group import DEFAULT_ARENA_BYTES, FrontendGroup
from server.observability.log_settings import LogControl
from server.observability.metrics import FrontDoorRequests, TraceCollector
from server.repository.registry import Registry
from server.repository.watcher import RepositoryWatcher
from server.doors.header_forward import header_forward
from server.doors.access import GRPC_HEADER_PREFIX, AccessPolicy, Restriction, restriction_table
from server.doors.grpc.auth import AccessCheck
from server.doors.grpc.drain import DrainGate
from server.doors.grpc.generate_servicer import GenerationServicer, generation_service
from server.doors.grpc.server import RpcOptions, RpcServer, inference_service
from server.doors.grpc.servicer import InferenceServicer
from server.tensors.shared_memory import SharedMemoryRegistry
from server.observability import traffic
from server.observability.tracing.control import TraceControl
from server.doors.tokens import Tokens
from server.observability.tracing.settings import OPENTELEMETRY, TraceSettings
from server.doors.http.server import WebOptions, WebServer

log = logging.getLogger("ferry")
QUIET_S = 1.0  # draining: no call for this long means the callers have moved to other replicas


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_repository: Path
    rpc: RpcOptions = field(default_factory=RpcOptions)
    metrics_port: int | None = 8002  # None: no metrics endpoint
    default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_queued_requests: int = MAX_QUEUED_REQUESTS
    max_queued_bytes: int | None = None  # request data queued in the whole server; None: a quarter of memory, 0: no bound
    max_model_queued_bytes: int | None = None  # ... per model version; None: half the server's, 0: only the server's
    drain_grace_s: float = DRAIN_GRACE_S
    poll_repository_s: float = 0.0  # > 0: hot reload, poll the repository this often
    tokens: Tokens = field(default_factory=Tokens)  # none: no authentication
    record_traffic: Path | None = None  # append one JSON line per request here (server/observability/traffic.py)
    metrics_host: str | None = None  # None: the gRPC host
    web: WebOptions | None = field(default_factory=WebOptions)  # None: no HTTP front door
    server_name: str = "ferry"  # ServerMetadata's name
    grpc_header_forward: str | None = None  # --grpc-header-forward-pattern: metadata made request parameters
    model_control_mode: str = "none"  # Triton's none (load all, refuse load/unload) | poll | explicit | on_demand (Ferry's)
    model_memory_budget: tuple[tuple[str, int], ...] = ()  # on_demand: (place, bytes), place 'host' or 'cuda:N'
    model_load_patience_s: float = 1.0  # on_demand: a load's wait for busy residents (server/repository/on_demand.py)
    rate_limit: str = "off"  # Triton's --rate-limit: off | execution_count (instance_group rate_limiter applied)
    rate_limit_resources: tuple = ()  # --rate-limit-resource: ((name, device or None for each device), count)
    allow_model_upload: bool = False  # explicit mode: loads may carry model files (`file:` parameters)
    allow_shared_memory: bool = False  # clients may register system shared-memory regions
    allow_log_settings: bool = False  # clients may change the log settings
    grpc_restricted: tuple[Restriction, ...] = ()  # Triton's --grpc-restricted-protocol groups
    http_restricted: tuple[Restriction, ...] = ()  # Triton's --http-restricted-api groups
    load_models: frozenset[str] | None = None  # explicit mode: the models loaded at start ('*': all)
    frontend_processes: int = 1  # >= 2: that many processes serve gRPC on the port (server/doors/processes/)
    frontend_arena_bytes: int = DEFAULT_ARENA_BYTES  # shared memory per front-end process for tensors
    event_loop: str = AUTO_LOOP  # the loop front-end processes run on (server/event_loop.py); the caller picks this one's
    response_cache_bytes: int = 0  # > 0: a response cache of this size for models that enable it (--cache-config)
    trace: TraceSettings = field(default_factory=TraceSettings)  # --trace-config (Triton's trace extension)
    allow_trace_settings: bool = False  # clients may change the trace settings (TraceSetting, POST /v2/trace/setting)
    backend_directory: Path | None = None  # --backend-directory: Python-based backends (<dir>/<name>/model.py); None: off


@dataclass(slots=True)
class ServerHealth:
    live: bool = True
    ready: bool = False


async def run(config: ServerConfig, started: asyncio.Event | None = None) -> int:
    """Serve until SIGINT/SIGTERM, then drain: refuse new work, finish admitted work, exit.

    Returns the exit status: 1 when front-end processes kept dying and the server stopped itself."""
    health = ServerHealth()
    log.info("event loop: %s", loop_name(asyncio.get_running_loop()))
    engine = build_engine(config)
    registry, prom, loop_load = engine.registry, engine.prom, engine.loop_load
    gate = DrainGate()
    grpc_access = AccessPolicy(config.tokens, restriction_table(list(config.grpc_restricted), GRPC_HEADER_PREFIX))
    http_access = AccessPolicy(config.tokens, restriction_table(list(config.http_restricted)))
    gates = [AccessCheck(grpc_access), gate] if grpc_access.enabled else [gate]
    control = engine.control
    # system shared memory regions clients register (only with --allow-shared-memory); released at shutdown
    regions = SharedMemoryRegistry(allow_register=config.allow_shared_memory)
    stop = asyncio.Event()
    tracing = trace_control(config, prom)
    logs = LogControl(allow_updates=config.allow_log_settings)  # LogSettings and /v2/logging (--allow-log-settings)
    group = rpc = web = http = None
    try:  # every port bound before anything starts or loads (server/doors/ports.py)
        rpc_options = config.rpc
        if config.frontend_processes > 1:
            group = FrontendGroup(config.frontend_processes, config.rpc, grpc_access, config.drain_grace_s,
                                  config.frontend_arena_bytes, config.event_loop, registry, gate, stop.set, tracing)
            rpc_options = replace(config.rpc, unix_socket=group.engine_socket)
        rpc = RpcServer(rpc_options, [inference_service(InferenceServicer(registry, health, logs, config.server_name,
                                                                          control, regions, tracing,
                                                                          header_forward(config.grpc_header_forward))),
                                      generation_service(GenerationServicer(registry, tracing))], gates)
        if config.web is not None:
            web = WebServer(config.web, registry, health, gate, http_access, FrontDoorRequests(prom), logs, control,
                            config.server_name, regions, tracing, prom if config.metrics_port is not None else None)
            await web.start()
        if config.metrics_port is not None:
            with claiming("metrics", config.metrics_host or config.rpc.host, config.metrics_port):
                http = MetricsServer(prom, config.metrics_host or config.rpc.host, config.metrics_port)
    except PortUnavailable:
        await _release(_Doors(gate, rpc, web, http, group))
        loop_load.close()
        await asyncio.to_thread(tracing.close)
        raise
    await rpc.start()
    if group is not None:
        await group.start()
    print(f"ferry: serving gRPC on {rpc.host}:{group.port if group else rpc.port}", flush=True)
    if web is not None:
        print(f"ferry: serving HTTP on {web.host}:{web.port}", flush=True)
    if http is not None:
        print(f"ferry: serving metrics on http://{config.metrics_host or config.rpc.host}:{http.port}/metrics", flush=True)
    recording = _record_traffic(config.record_traffic)
    heap.keep()  # before models allocate: a step's big tensors reuse the heap (server/heap.py)
    await engine.load(config)
    heap.park()
    health.ready = True
    await rpc.set_serving(True)
    for row in registry.index():
        log.info("model %-24s %-11s %s", row.name, row.state, row.reason)
    watcher = None
    if config.poll_repository_s > 0:
        watcher = RepositoryWatcher(registry, config.poll_repository_s)
        await watcher.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before "ready": a SIGTERM right after it must drain, not kill
        loop.add_signal_handler(sig, stop.set)
    print("ferry: ready", flush=True)
    if started is not None:
        started.set()
    await stop.wait()

    health.ready = False
    await _drain(config, _Doors(gate, rpc, web, http, group), registry, watcher)
    regions.close()  # no gRPC call is left to use them
    _stop_recording(recording)
    await asyncio.to_thread(tracing.close)  # the trace file complete, the last spans exported (bounded)
    loop_load.close()
    print("ferry: stopped", flush=True)
    return 1 if group is not None and group.failed else 0


def _record_traffic(path: Path | None) -> asyncio.Task | None:
    """Start the traffic recording, flushed twice a second so a reader sees it while the server runs."""
    if path is None:
        return None
    traffic.start(path)
    log.info("recording traffic to %s", path)

    async def flush() -> None:
        while True:
            await asyncio.sleep(0.5)
            traffic.flush()

    return asyncio.ensure_future(flush())


def _stop_recording(recording: asyncio.Task | None) -> None:
    if recording is not None:
        recording.cancel()
        traffic.stop()


def trace_control(config: ServerConfig, prom: CollectorRegistry) -> TraceControl:
    """Tracing as --trace-config sets it: Triton's trace file, or OpenTelemetry spans over OTLP/HTTP."""
    settings, otel = config.trace, None
    if settings.mode == OPENTELEMETRY:
        from server.observability.tracing.otel import OtelExporter  # the SDK is imported only when it is used

        otel = OtelExporter(settings.otel)
        prom.register(TraceCollector(otel))
        log.info("tracing: OpenTelemetry spans to %s (level %s, rate %d)", settings.otel.url or "the OTEL_* endpoint",
                 ",".join(settings.level) or "OFF", settings.rate)
    elif settings.on:
        log.info("tracing: Triton trace file %s (level %s, rate %d, count %d, log-frequency %d)", settings.file,
                 ",".join(settings.level), settings.rate, settings.count, settings.log_frequency)
    return TraceControl(settings, config.allow_trace_settings, otel)


async def _release(doors: _Doors) -> None:
    """Close the doors bound before one of the ports turned out to be taken; nothing was served on them."""
    if doors.rpc is not None:
        await doors.rpc.stop(0)
    if doors.web is not None:
        await doors.web.stop(0)
    if doors.metrics is not None:
        doors.metrics.shutdown()
    if doors.frontends is not None:
        doors.frontends.release()


@dataclass(slots=True)
class _Doors:
    gate: DrainGate
    rpc: RpcServer | None
    web: WebServer | None
    metrics: MetricsServer | None
    frontends: FrontendGroup | None


async def _drain(config: ServerConfig, doors: _Doors, registry: Registry, watcher: RepositoryWatcher | None) -> None:
    """In order: every door refuses new calls (front-end processes first), admitted work is answered, doors stop."""
    loop = asyncio.get_running_loop()
    log.info("draining: refusing new requests, finishing admitted ones (grace %.0fs)", config.drain_grace_s)
    began = loop.time()
    doors.gate.close()  # new calls: UNAVAILABLE / 503 at once; both doors keep running so none of them is cut off
    await doors.rpc.set_serving(False)
    if doors.frontends is not None:
        doors.frontends.drain()  # they shut their own gates now and exit once the engine has answered them
    if watcher is not None:
        await watcher.stop()
    await registry.close(config.drain_grace_s)  # whatever is cut off is answered UNAVAILABLE by the runners
    if doors.frontends is not None:
        await doors.frontends.stop(max(QUIET_S, config.drain_grace_s - (loop.time() - began)))
    # Every admitted request has its answer now. Wait (within the grace) for callers to move away, then
    # stop gRPC; calls still open (a stream its client keeps open) get at least a second more.
    if not await doors.gate.quiet(QUIET_S, config.drain_grace_s - (loop.time() - began)):
        log.warning("draining: callers still arriving when the grace ran out; stopping gRPC cancels them")
    log.info("draining: admitted work answered, %d calls refused, callers gone after %.2fs; stopping gRPC",
             doors.gate.refused, loop.time() - began)
    await doors.rpc.stop(max(1.0, config.drain_grace_s - (loop.time() - began)))
    if doors.web is not None:
        await doors.web.stop(max(1.0, config.drain_grace_s - (loop.time() - began)))
    if doors.metrics is not None:
        doors.metrics.shutdown()

"""KServe v2 REST, as Triton serves it: health, metadata, config, statistics, repository, infer.

Each handler reads the URL and body, calls the registry or a runner exactly as the gRPC servicer
does (server/doors/shared.py is shared), and writes Triton's JSON; errors go through web/errors.py.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server import __version__
from server.config_json import config_json
from server.errors import InvalidInputError, ModelNotFoundError, ModelUnavailableError
from server.doors.shared import class_counts, classified, infer_request, model_ready, serving
from server.observability.log_settings import LogControl
from server.doors.model_control import ModelControl
from server.observability.metrics import INFER_DURATIONS
from server.names import parse_version, shown
from server.repository.registry import READY, ModelVersion, Registry
from server.runners.base import INFER
from server.tensors.shared_memory import SharedMemoryRegistry
from server.observability.tracing import doors as trace_doors
from server.observability.tracing.control import TraceControl
from server.observability.tracing.record import HTTP_RECV_END
from server.doors.header_forward import HeaderForward
from server.tensors.wire import ByteSizeError
from server.doors.http import raw_body, tensors
from server.doors.http.body import read_body
from server.doors.http.errors import kserve_error, message_of, status_of

EXTENSIONS = ["model_repository", "model_configuration", "statistics", "schedule_policy", "system_shared_memory",
              "binary_tensor_data", "generate", "logging", "trace"]


def kserve_errors(handler):
    """Any error becomes KServe's `{"error": ...}` with Triton's status for it."""

    @functools.wraps(handler)
    async def wrapper(self, request: Request):
        try:
            return await handler(self, request)
        except Exception as exc:  # noqa: BLE001 - every failure is answered; message_of logs the unexpected ones
            return kserve_error(status_of(exc), message_of(exc))

    return wrapper


def model_paths(suffix: str) -> list[str]:
    return [f"/v2/models/{{name}}{suffix}", f"/v2/models/{{name}}/versions/{{version}}{suffix}"]


class KServeRoutes:
    def __init__(self, registry: Registry, health, body_limit: int, logs: LogControl, control: ModelControl,
                 server_name: str = "ferry", regions: SharedMemoryRegistry | None = None,
                 tracing: TraceControl | None = None, forward: HeaderForward | None = None):
        self.registry, self.health, self.body_limit, self.control = registry, health, body_limit, control
        self.forward = forward  # --http-header-forward-pattern: headers made request parameters
        self.logs, self.server_name = logs, server_name  # the name ServerMetadata gives on gRPC too (--server-name)
        self.regions = regions if regions is not None else SharedMemoryRegistry()  # shared with gRPC's
        self.tracing = tracing or TraceControl()

    def routes(self) -> list[Route]:
        table = [("/v2/health/live", self.live, "GET"), ("/v2/health/ready", self.ready, "GET"),
                 ("/v2", self.server_metadata, "GET"), ("/v2/models/stats", self.statistics, "GET"),
                 ("/v2/repository/index", self.repository_index, "POST"),
                 ("/v2/repository/models/{name}/load", self.load, "POST"),
                 ("/v2/repository/models/{name}/unload", self.unload, "POST"),
                 ("/v2/logging", self.logging, "GET"), ("/v2/logging", self.logging, "POST"),
                 *((path, self.trace_setting, method) for path in ("/v2/trace/setting", "/v2/models/{name}/trace/setting")
                   for method in ("GET", "POST"))]
        for suffix, handler, method in (("/ready", self.model_ready, "GET"), ("/config", self.model_config, "GET"),
                                        ("/stats", self.statistics, "GET"), ("/infer", self.infer, "POST"),
                                        ("", self.model_metadata, "GET")):
            table += [(path, handler, method) for path in model_paths(suffix)]
        return [Route(path, handler, methods=[method]) for path, handler, method in table]

    async def live(self, request: Request) -> Response:
        """Triton's status (400 when not live/ready), which tritonclient reads, with the body KServe's servers
        send and its SDK parses (`InferenceRESTClient.is_server_live` reads `live` from the JSON)."""
        live = bool(self.health.live)
        return JSONResponse({"live": live}, status_code=200 if live else 400)

    async def ready(self, request: Request) -> Response:
        ready = bool(self.health.ready)
        return JSONResponse({"ready": ready}, status_code=200 if ready else 400)

    async def server_metadata(self, request: Request) -> Response:
        return JSONResponse({"name": self.server_name, "version": __version__, "extensions": EXTENSIONS})

    @kserve_errors
    async def model_ready(self, request: Request) -> Response:
        name, version = _model(request)
        if not self.registry.knows(name):
            self.registry.get(name)  # raises NOT_FOUND
        try:
            ready = await model_ready(self.registry.get(name, version, cold_ok=True))
        except (ModelNotFoundError, ModelUnavailableError):  # a known model whose version cannot serve
            ready = False
        return JSONResponse({"name": name, "ready": ready}, status_code=200 if ready else 400)

    @kserve_errors
    async def model_metadata(self, request: Request) -> Response:
        mv = self.registry.get(*_model(request), cold_ok=True)
        sig = mv.signature

        def describe(specs):
            return [{"name": s.name, "datatype": s.datatype.api, "shape": s.shape_for_metadata(sig.batching)}
                    for s in specs.values()]

        return JSONResponse({"name": mv.name, "versions": [str(v) for v in self.registry.listed_versions(mv.name)],
                             "platform": mv.config.platform or mv.config.backend,
                             "inputs": describe(sig.inputs), "outputs": describe(sig.outputs)})

    @kserve_errors
    async def model_config(self, request: Request) -> Response:
        config = self.registry.get(*_model(request), cold_ok=True).config
        return JSONResponse(config_json(config))

    @kserve_errors
    async def statistics(self, request: Request) -> Response:
        name, version = _model(request)
        if name:
            self.registry.get(name)  # unknown model -> NOT_FOUND
        versions = [mv for mv in self.registry.all_versions(name) if mv.runner is not None]
        if version:
            number = parse_version(version)
            versions = [mv for mv in versions if mv.version == number]
        return JSONResponse({"model_stats": [_statistics(mv) for mv in versions]})

    @kserve_errors
    async def repository_index(self, request: Request) -> Response:
        body = await self._json(request, default={})
        if not isinstance(body.get("ready", False), bool):
            raise InvalidInputError("Invalid value for 'ready': expected a boolean")
        rows = self.registry.index()
        if body.get("ready"):
            rows = [r for r in rows if r.state == READY]
        return JSONResponse([{"name": r.name, "version": r.version, "state": r.state, "reason": r.reason} for r in rows])

    @kserve_errors
    async def logging(self, request: Request) -> Response:
        """Triton's logging extension: GET reads the settings, POST changes some and answers them all."""
        if request.method == "GET":
            return JSONResponse(self.logs.values)
        return JSONResponse(self.logs.update(await self._json(request, default={})))

    @kserve_errors
    async def trace_setting(self, request: Request) -> Response:
        """Triton's trace extension: GET reads the settings (global, or a model's), POST changes some (a JSON
        null clears one: the global value, or for the global settings the one the server started with)."""
        model = request.path_params.get("name", "")
        trace_doors.check_model(self.registry, model)
        changes = await self._json(request, default={}) if request.method == "POST" else {}
        return JSONResponse(self.tracing.update(changes, model or None))

    @kserve_errors
    async def load(self, request: Request) -> Response:
        body = await self._json(request, default={})
        await self.control.load(request.path_params["name"], load_parameters(body.get("parameters") or {}))
        return Response(status_code=200)

    @kserve_errors
    async def unload(self, request: Request) -> Response:
        await self._json(request, default={})
        await self.control.unload(request.path_params["name"])
        return Response(status_code=200)

    @kserve_errors
    async def infer(self, request: Request) -> Response:
        async with self.registry.lease(request.path_params.get("name", ""), None):  # on demand: loaded first
            return await self._traced_infer(request)

    async def _traced_infer(self, request: Request) -> Response:
        arrival = time.monotonic_ns()
        if self.tracing.active:
            trace = self.tracing.begin(request.path_params.get("name", ""), "", arrival, request.headers)
            if trace is not None:
                return await trace_doors.http_unary(trace, arrival, self._infer(request, arrival, trace))
        return await self._infer(request, arrival)

    async def _infer(self, request: Request, arrival: int, trace=None) -> Response:
        mv = serving(self.registry, *_model(request), INFER)
        body = await read_body(request, self.body_limit)
        if trace is not None:
            trace.mark(HTTP_RECV_END)
        decoded = self._decode(mv, body, request.headers.get("inference-header-content-length"))
        if self.forward is not None:
            decoded.parameters.update(self.forward.parameters(request.headers.items()))
        infer = infer_request(mv, decoded.inputs, decoded.requested, decoded.parameters, decoded.id, arrival, None)
        counts = class_counts(decoded.classes, mv.signature)  # refused before any work, as on gRPC
        targets = self.regions.targets(decoded.placements)  # regions checked before any work
        if trace is not None:
            trace_doors.attach(trace, infer, mv.version)
        held = self.regions.hold([*decoded.input_regions, *(p.region for p in decoded.placements)]) if self.regions else ()
        try:  # a region unregistered meanwhile stays registered until this request ends, as in Triton
            outputs = await mv.runner.infer(infer)
            if trace is not None:
                trace_doors.answered(trace, outputs)
            if counts:
                outputs = classified(outputs, counts, mv.signature)
            names = infer.requested_outputs or tuple(mv.signature.outputs)
            data, header_length = tensors.encode_infer(decoded, mv.name, mv.version, outputs, names, targets)
        finally:
            self.regions.release(held)
        if header_length is None:
            return Response(data, media_type="application/json")
        return Response(data, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(header_length)})

    def _decode(self, mv: ModelVersion, body: bytes, header_length: str | None) -> tensors.DecodedInfer:
        try:
            if raw_body.is_raw(header_length):  # no JSON header: the body is the one input's bytes
                return raw_body.decode_raw(mv.signature, body)
            return tensors.decode_infer(*tensors.split_body(body, header_length), self.regions, self.body_limit)
        except ByteSizeError as exc:  # Triton's words name the model
            raise exc.for_model(mv.name) from None

    async def _json(self, request: Request, default):
        body = await read_body(request, self.body_limit)
        if not body:
            return default
        parsed = tensors.parse_json(body)
        if not isinstance(parsed, dict):
            raise InvalidInputError(f"the request body must be a JSON object, got {type(parsed).__name__}")
        return parsed


def load_parameters(parameters) -> dict:
    """Triton's HTTP load parameters -> what the gRPC door decodes: `config` a JSON string (an object is
    taken too), each `file:<path>` base64 text -> its bytes."""
    if not isinstance(parameters, dict):
        raise InvalidInputError(f"the load's 'parameters' must be a JSON object, got {type(parameters).__name__}")
    decoded = {}
    for key, value in parameters.items():
        if key == "config" and isinstance(value, dict):
            value = json.dumps(value)
        elif key.startswith("file:"):
            if not isinstance(value, str):
                raise InvalidInputError(f"load parameter {shown(key)} must be the file's content in base64 text")
            try:
                value = base64.b64decode(value, validate=True)
            except binascii.Error as exc:
                raise InvalidInputError(f"load parameter {shown(key)} is not valid base64: {exc}") from None
        decoded[key] = value
    return decoded


def _model(request: Request) -> tuple[str, str]:
    return request.path_params.get("name", ""), request.path_params.get("version", "")


def _statistics(mv: ModelVersion) -> dict:
    snap = mv.runner.stats.snapshot()

    def duration(pair):
        return {"count": pair[0], "ns": pair[1]}

    return {
        "name": mv.name, "version": str(mv.version), "last_inference": snap["last_inference"],
        "inference_count": snap["inference_count"], "execution_count": snap["execution_count"],
        "inference_stats": {k: duration(snap[k]) for k in INFER_DURATIONS},
        "batch_stats": [{"batch_size": size, **{k: duration(v) for k, v in times.items()}}
                        for size, times in snap["batches"].items()],
        # Ferry's: what the version holds (server/repository/footprint.py), by place; Triton clients ignore it
        "memory_bytes": dict(mv.footprint.bytes_by_place) if mv.footprint is not None else {},
        "memory_declared": bool(mv.footprint is not None and mv.footprint.declared),
    }

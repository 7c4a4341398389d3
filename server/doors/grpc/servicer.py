"""KServe v2 / Triton GRPCInferenceService: decode -> look up -> submit -> await -> encode."""

from __future__ import annotations

import contextlib
import time

from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from server import __version__
from server.errors import FerryError, InvalidInputError, ModelNotFoundError, ModelUnavailableError
from server.doors.shared import class_counts, classified, infer_request, model_ready, serving
from server.observability.log_settings import LogControl
from server.doors.model_control import ModelControl
from server.doors.header_forward import HeaderForward
from server.tensors.wire import ByteSizeError
from server.observability.metrics import INFER_DURATIONS
from server.names import parse_version
from server.repository.registry import READY, ModelVersion, Registry
from server.request import InferRequest, parameters_of
from server.doors.grpc import codec
from server.doors.grpc import shared_memory as shm_rpc
from server.doors.grpc.errors import abort_for, translate_errors
from server.doors.grpc.response_bytes import response_bytes
from server.doors.grpc.stream_infer import stream_infer
from server.runners.base import DECOUPLED, INFER
from server.tensors.shared_memory import SharedMemoryRegistry
from server.observability.tracing import doors as trace_doors
from server.observability.tracing.control import TraceControl
from server.observability.tracing.record import REQUEST_END
from server.observability.tracing.streams import StreamTracing

# Only what is implemented: perf_analyzer reads statistics only when "statistics" is listed.
EXTENSIONS = ["model_repository", "model_configuration", "statistics", "schedule_policy", "system_shared_memory",
              "logging", "trace"]


class InferenceServicer(shm_rpc.SharedMemoryRpcs, pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, registry: Registry, health, logs: LogControl, server_name: str = "ferry",
                 control: ModelControl | None = None, shared_memory: SharedMemoryRegistry | None = None,
                 tracing: TraceControl | None = None, header_forward: HeaderForward | None = None):
        self.header_forward = header_forward  # --grpc-header-forward-pattern: headers made request parameters
        self.shared_memory = shared_memory if shared_memory is not None else SharedMemoryRegistry()  # the app releases it
        self.registry = registry
        self.health = health  # ServerHealth: live / ready flags owned by the app
        self.server_name = server_name  # some Triton clients check for "triton" (--server-name)
        self.control = control or ModelControl(registry)  # load / unload, as the server's model control mode allows
        self.logs = logs  # LogSettings: what the server writes to its log, changed while it runs
        self.tracing = tracing or TraceControl()  # Triton's trace extension (TraceSetting), sampling per request
        self._read_shared = shm_rpc.input_reader(self.shared_memory)  # made once, not per request

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self.health.live)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.health.ready)

    @translate_errors
    async def LogSettings(self, request, context):
        """Triton's logging extension: an empty request reads the settings; one with settings changes them."""
        changes = {key: _setting(key, value) for key, value in request.settings.items()}
        values = self.logs.update(changes) if changes else self.logs.values
        return pb.LogSettingsResponse(settings={key: _setting_value(value) for key, value in values.items()})

    @translate_errors
    async def TraceSetting(self, request, context):
        """Triton's trace extension: settings given are changed (an empty value list clears one), all returned."""
        model = request.model_name
        trace_doors.check_model(self.registry, model)
        changes = {key: list(value.value) or None for key, value in request.settings.items()}
        values = self.tracing.update(changes, model or None)
        return pb.TraceSettingResponse(settings={key: pb.TraceSettingResponse.SettingValue(
            value=value if isinstance(value, list) else [value]) for key, value in values.items()})

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=self.server_name, version=__version__, extensions=EXTENSIONS)

    @translate_errors
    async def ModelReady(self, request, context):
        if not self.registry.knows(request.name):
            if self.registry.on_disk(request.name):  # in the repository, not loaded (explicit mode): not ready
                return pb.ModelReadyResponse(ready=False)
            self.registry.get(request.name)  # raises NOT_FOUND
        try:
            return pb.ModelReadyResponse(ready=await model_ready(self.registry.get(request.name, request.version, cold_ok=True)))
        except (ModelNotFoundError, ModelUnavailableError):  # a known model whose version cannot serve
            return pb.ModelReadyResponse(ready=False)

    @translate_errors
    async def ModelMetadata(self, request, context):
        mv = self.registry.get(request.name, request.version, cold_ok=True)
        sig, config = mv.signature, mv.config
        response = pb.ModelMetadataResponse(
            name=mv.name, versions=[str(v) for v in self.registry.listed_versions(mv.name)],
            platform=config.platform or config.backend,
        )
        for target, specs in ((response.inputs, sig.inputs), (response.outputs, sig.outputs)):
            for spec in specs.values():
                target.add(name=spec.name, datatype=spec.datatype.api, shape=spec.shape_for_metadata(sig.batching))
        return response

    @translate_errors
    async def ModelConfig(self, request, context):
        return pb.ModelConfigResponse(config=self.registry.get(request.name, request.version, cold_ok=True).config)

    @translate_errors
    async def ModelStatistics(self, request, context):
        if request.name:
            self.registry.get(request.name)  # unknown model -> NOT_FOUND
        versions = [mv for mv in self.registry.all_versions(request.name) if mv.runner is not None]
        if request.version:
            number = parse_version(request.version)
            versions = [mv for mv in versions if mv.version == number]
        return pb.ModelStatisticsResponse(model_stats=[_statistics(mv) for mv in versions])

    @translate_errors
    async def RepositoryIndex(self, request, context):
        rows = self.registry.index()
        if request.ready:
            rows = [r for r in rows if r.state == READY]
        models = [pb.RepositoryIndexResponse.ModelIndex(name=r.name, version=r.version, state=r.state, reason=r.reason)
                  for r in rows]
        return pb.RepositoryIndexResponse(models=models)

    @translate_errors
    async def RepositoryModelLoad(self, request, context):
        # The KServe SDK's variant of this message puts the model name in field 1 (repository_name).
        await self.control.load(request.model_name or request.repository_name, codec.decode_parameters(request.parameters))
        return pb.RepositoryModelLoadResponse()

    @translate_errors
    async def RepositoryModelUnload(self, request, context):
        await self.control.unload(request.model_name or request.repository_name)
        return pb.RepositoryModelUnloadResponse()

    @translate_errors
    async def ModelInfer(self, request, context):
        if self.registry.on_demand is not None:  # its model may have to load first (server/repository/on_demand.py)
            async with self.registry.on_demand.lease(request.model_name, _wait_bound(request, context.time_remaining())):
                return await self._model_infer(request, context)
        return await self._model_infer(request, context)

    async def _model_infer(self, request, context):
        arrival = time.monotonic_ns()
        if self.tracing.active:
            trace = self.tracing.begin(request.model_name, request.id, arrival, trace_doors.grpc_carrier(context))
            if trace is not None:
                call = self._infer(request, arrival, context.time_remaining(), trace, self._forwarded(context))
                return await trace_doors.grpc_unary(trace, arrival, context, call)
        # Untraced (nearly every call): _infer's steps without a coroutine of its own, answered as bytes (_reply).
        mv, infer, counts, targets = self._admit(request, arrival, context.time_remaining(), self._forwarded(context))
        if not self.shared_memory:  # no region registered: none to keep while this request runs
            return _reply(request, mv, infer, await mv.runner.infer(infer), counts, targets)
        held = self.shared_memory.hold(shm_rpc.region_names(request))
        try:  # a region unregistered meanwhile stays registered until this request ends, as in Triton
            return _reply(request, mv, infer, await mv.runner.infer(infer), counts, targets)
        finally:
            self.shared_memory.release(held)

    async def ModelStreamInfer(self, request_iterator, context):
        async def infer_one(request, arrival, trace):  # the stream's headers, read per request so a refusal is its answer
            return await self._infer(request, arrival, context.time_remaining(), trace, self._forwarded(context))

        def stream_one(request, arrival, trace):
            return self._stream(request, arrival, context.time_remaining(), trace, context)

        remaining = context.time_remaining()
        deadline = time.monotonic_ns() + int(remaining * 1e9) if remaining is not None else None
        errors_end = dict(context.invocation_metadata() or ()).get("triton_grpc_error") == "true"
        streams = stream_infer(self.registry, request_iterator, infer_one, deadline, stream_one,
                               StreamTracing(self.tracing, context), errors_end)
        try:
            async with contextlib.aclosing(streams) as responses:
                async for response in responses:
                    yield response
        except FerryError as exc:  # only with `triton_grpc_error: true`: Triton ends such a stream at its first error
            await abort_for(exc, context, "ModelStreamInfer")

    def _forwarded(self, context) -> dict[str, str] | None:
        """The request parameters --grpc-header-forward-pattern makes of the call's metadata (None: no pattern)."""
        if self.header_forward is None:
            return None
        return self.header_forward.parameters(context.invocation_metadata() or ())

    async def _infer(self, request: pb.ModelInferRequest, arrival: int, remaining_s: float | None, trace=None,
                     forwarded: dict | None = None):
        mv, infer, counts, targets = self._admit(request, arrival, remaining_s, forwarded)
        if trace is not None:
            trace_doors.attach(trace, infer, mv.version)
        held = self.shared_memory.hold(shm_rpc.region_names(request)) if self.shared_memory else ()
        try:  # see ModelInfer
            outputs = await mv.runner.infer(infer)
            if trace is not None:
                trace_doors.answered(trace, outputs)
            return _response(request, mv, infer, outputs, counts, targets)
        finally:
            self.shared_memory.release(held)

    def _admit(self, request: pb.ModelInferRequest, arrival: int, remaining_s: float | None, forwarded: dict | None = None):
        """The version to serve, the checked request, its classification counts and its output regions (checked
        before any work)."""
        mv = serving(self.registry, request.model_name, request.model_version, INFER)
        wanted = request.outputs  # read once: each access of a repeated field builds a new wrapper
        infer, counts = _decode(request, mv, arrival, remaining_s, self._read_shared, wanted, forwarded)
        return mv, infer, counts, (shm_rpc.output_targets(self.shared_memory, wanted) if wanted else {})

    async def _stream(self, request: pb.ModelInferRequest, arrival: int, remaining_s: float | None, trace=None, context=None):
        """A decoupled model's responses to one request, each encoded as it comes."""
        mv = serving(self.registry, request.model_name, request.model_version, DECOUPLED)
        forwarded = self._forwarded(context) if context is not None else None
        infer, _ = _decode(request, mv, arrival, remaining_s, self._read_shared, request.outputs, forwarded)
        wanted = _names(infer, mv)
        if trace is not None:
            trace_doors.attach(trace, infer, mv.version)
        async with contextlib.aclosing(mv.runner.stream(infer)) as responses:
            async for outputs in responses:
                yield codec.encode_response(request, mv.version, outputs, tuple(n for n in wanted if n in outputs))
        if trace is not None:
            trace.mark(REQUEST_END)


def _wait_bound(request: pb.ModelInferRequest, remaining_s: float | None) -> float | None:
    """How long a request may wait for its model's on-demand load: its RPC deadline, or its own `timeout`
    parameter (microseconds, as the queue counts it) when that comes first."""
    if "timeout" in request.parameters:
        timeout_us = request.parameters["timeout"].int64_param
        if timeout_us > 0:
            return timeout_us / 1e6 if remaining_s is None else min(remaining_s, timeout_us / 1e6)
    return remaining_s


def _reply(request: pb.ModelInferRequest, mv: ModelVersion, infer: InferRequest, outputs: dict, counts: dict[str, int],
           targets: dict) -> pb.ModelInferResponse | bytes:
    """ModelInfer's answer: its bytes composed (response_bytes.py) when it is arrays only; the message when it
    carries classes, outputs in shared memory or the model's response parameters."""
    if counts or targets or parameters_of(outputs):
        return _response(request, mv, infer, outputs, counts, targets)
    return response_bytes(request.model_name, request.id, mv.version, outputs, _names(infer, mv))


def _response(request: pb.ModelInferRequest, mv: ModelVersion, infer: InferRequest, outputs: dict, counts: dict[str, int],
              targets: dict) -> pb.ModelInferResponse:
    if counts:
        outputs = classified(outputs, counts, mv.signature)
    return codec.encode_response(request, mv.version, outputs, _names(infer, mv), targets)


def _names(infer: InferRequest, mv: ModelVersion) -> tuple[str, ...]:
    """The outputs a reply carries, in order: those asked for, else all the model has."""
    return infer.requested_outputs or tuple(mv.signature.outputs)


def _decode(request: pb.ModelInferRequest, mv: ModelVersion, arrival_ns: int, remaining_s: float | None,
            read_shared, wanted, forwarded: dict | None = None) -> tuple[InferRequest, dict[str, int]]:
    """The checked request, and the outputs asked for (`wanted`: its `outputs`) as classes (output name -> k;
    a bad `classification` is refused here, before any work). `forwarded`: parameters from headers."""
    try:
        inputs = codec.decode_inputs(request, read_shared)
    except ByteSizeError as exc:  # Triton's words name the model
        raise exc.for_model(mv.name) from None
    requested = tuple(o.name for o in wanted) if wanted else ()
    params = codec.decode_parameters(request.parameters)
    if forwarded:
        params = {**params, **forwarded}
    infer = infer_request(mv, inputs, requested, params, request.id, arrival_ns, remaining_s, _nbytes(request, inputs))
    return infer, (_class_counts(wanted, mv.signature) if wanted else {})


def _nbytes(request: pb.ModelInferRequest, inputs) -> int:
    """The input data a queued request holds: raw contents are viewed in place; typed ones and those copied
    out of shared memory were decoded into arrays."""
    raw = request.raw_input_contents
    if raw:
        total = sum(map(len, raw))
        if len(raw) == len(inputs):  # one raw entry per input (decode_inputs checked): none in shared memory
            return total
        for t in request.inputs:
            if shm_rpc.REGION in t.parameters:
                total += inputs[t.name].nbytes
        return total
    return sum(array.nbytes for array in inputs.values())


def _class_counts(wanted, signature) -> dict[str, int]:
    return class_counts(((w.name, codec.decode_parameters(w.parameters))
                         for w in wanted if "classification" in w.parameters), signature)


def _setting(key: str, value: pb.LogSettingsRequest.SettingValue) -> bool | int | str:
    choice = value.WhichOneof("parameter_choice")
    if choice is None:
        raise InvalidInputError(f"log setting '{key}' has no value (bool_param, uint32_param or string_param)")
    return getattr(value, choice)


def _setting_value(value: bool | int | str) -> pb.LogSettingsResponse.SettingValue:
    field = {bool: "bool_param", int: "uint32_param", str: "string_param"}[type(value)]
    return pb.LogSettingsResponse.SettingValue(**{field: value})


def _statistics(mv: ModelVersion) -> pb.ModelStatistics:
    snap = mv.runner.stats.snapshot()

    def duration(pair):
        return pb.StatisticDuration(count=pair[0], ns=pair[1])

    stats = pb.ModelStatistics(
        name=mv.name, version=str(mv.version), last_inference=snap["last_inference"],
        inference_count=snap["inference_count"], execution_count=snap["execution_count"],
        inference_stats=pb.InferStatistics(**{k: duration(snap[k]) for k in INFER_DURATIONS}),
    )
    for size, times in snap["batches"].items():
        stats.batch_stats.add(batch_size=size, **{k: duration(v) for k, v in times.items()})
    return stats

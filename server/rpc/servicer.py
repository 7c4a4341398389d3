"""KServe v2 / Triton GRPCInferenceService: decode -> look up -> submit -> await -> encode."""

from __future__ import annotations

import contextlib
import time

from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from server import __version__
from server.errors import InvalidInputError, ModelNotFoundError, ModelUnavailableError, UnsupportedError
from server.names import capped, parse_version
from server.repository.registry import READY, ModelVersion, Registry
from server.request import InferRequest
from server.rpc import codec
from server.rpc.errors import translate_errors
from server.rpc.lookup import serving
from server.rpc.stream_infer import stream_infer
from server.runners.base import DECOUPLED, INFER

# Only what is implemented: perf_analyzer reads statistics only when "statistics" is listed.
EXTENSIONS = ["model_repository", "model_configuration", "statistics", "schedule_policy"]


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, registry: Registry, health):
        self.registry = registry
        self.health = health  # ServerHealth: live / ready flags owned by the app

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self.health.live)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.health.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="ferry", version=__version__, extensions=EXTENSIONS)

    @translate_errors
    async def ModelReady(self, request, context):
        if not self.registry.knows(request.name):
            self.registry.get(request.name)  # raises NOT_FOUND
        try:
            return pb.ModelReadyResponse(ready=self.registry.get(request.name, request.version).ready)
        except (ModelNotFoundError, ModelUnavailableError):  # a known model whose version cannot serve
            return pb.ModelReadyResponse(ready=False)

    @translate_errors
    async def ModelMetadata(self, request, context):
        mv = self.registry.get(request.name, request.version)
        sig, config = mv.signature, mv.config
        response = pb.ModelMetadataResponse(
            name=mv.name, versions=[str(v) for v in self.registry.ready_versions(mv.name)],
            platform=config.platform or config.backend,
        )
        for target, specs in ((response.inputs, sig.inputs), (response.outputs, sig.outputs)):
            for spec in specs.values():
                target.add(name=spec.name, datatype=spec.datatype.api, shape=spec.shape_for_metadata(sig.batching))
        return response

    @translate_errors
    async def ModelConfig(self, request, context):
        return pb.ModelConfigResponse(config=self.registry.get(request.name, request.version).config)

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
        if request.parameters:
            given = capped(str(sorted(request.parameters)), 300)
            raise UnsupportedError(f"load parameters {given} (config override, files) are not supported; "
                                   "edit the model folder and load it again")
        # The KServe SDK's variant of this message puts the model name in field 1 (repository_name).
        await self.registry.load(request.model_name or request.repository_name)
        return pb.RepositoryModelLoadResponse()

    @translate_errors
    async def RepositoryModelUnload(self, request, context):
        await self.registry.unload(request.model_name or request.repository_name)
        return pb.RepositoryModelUnloadResponse()

    @translate_errors
    async def ModelInfer(self, request, context):
        arrival = time.monotonic_ns()
        return await self._infer(request, arrival, context.time_remaining())

    async def ModelStreamInfer(self, request_iterator, context):
        async def infer_one(request, arrival):
            return await self._infer(request, arrival, context.time_remaining())

        def stream_one(request, arrival):
            return self._stream(request, arrival, context.time_remaining())

        remaining = context.time_remaining()
        deadline = time.monotonic_ns() + int(remaining * 1e9) if remaining is not None else None
        streams = stream_infer(self.registry, request_iterator, infer_one, deadline, stream_one)
        async with contextlib.aclosing(streams) as responses:
            async for response in responses:
                yield response

    async def _infer(self, request: pb.ModelInferRequest, arrival: int, remaining_s: float | None):
        mv = serving(self.registry, request.model_name, request.model_version, INFER)
        infer = _decode(request, mv, arrival, remaining_s)
        outputs = await mv.runner.infer(infer)
        names = infer.requested_outputs or tuple(mv.signature.outputs)
        return codec.encode_response(request, mv.version, outputs, names)

    async def _stream(self, request: pb.ModelInferRequest, arrival: int, remaining_s: float | None):
        """A decoupled model's responses to one request, each encoded as it comes."""
        mv = serving(self.registry, request.model_name, request.model_version, DECOUPLED)
        infer = _decode(request, mv, arrival, remaining_s)
        wanted = infer.requested_outputs or tuple(mv.signature.outputs)
        async with contextlib.aclosing(mv.runner.stream(infer)) as responses:
            async for outputs in responses:
                yield codec.encode_response(request, mv.version, outputs, tuple(n for n in wanted if n in outputs))


def _decode(request: pb.ModelInferRequest, mv: ModelVersion, arrival_ns: int, remaining_s: float | None) -> InferRequest:
    inputs = codec.decode_inputs(request)
    batch_size, key = mv.signature.check_inputs(inputs)
    requested = tuple(o.name for o in request.outputs)
    mv.signature.check_outputs(requested)
    params = codec.decode_parameters(request.parameters)
    priority, timeout_us = params.pop("priority", 0), params.pop("timeout", 0)
    for name, value in (("priority", priority), ("timeout", timeout_us)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidInputError(f"parameter '{name}' must be a non-negative integer, got {capped(repr(value), 100)}")
    cost = params.pop("cost", 0)  # per row, for cost-aware batching; 0: derived from the length
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost < float("inf"):
        raise InvalidInputError(f"parameter 'cost' must be a non-negative number, got {capped(repr(cost), 100)}")
    return InferRequest(
        model_name=mv.name, inputs=inputs, batch_size=batch_size, batch_key=key, id=request.id,
        requested_outputs=requested, parameters=params, priority=priority, timeout_us=timeout_us,
        deadline_ns=arrival_ns + int(remaining_s * 1e9) if remaining_s is not None else None,
        arrival_ns=arrival_ns, length=mv.signature.length(inputs), cost=float(cost), nbytes=_nbytes(request, inputs),
    )


def _nbytes(request: pb.ModelInferRequest, inputs) -> int:
    """The input data a queued request holds: raw contents are viewed in place, typed ones were decoded."""
    if request.raw_input_contents:
        return sum(map(len, request.raw_input_contents))
    return sum(array.nbytes for array in inputs.values())


def _statistics(mv: ModelVersion) -> pb.ModelStatistics:
    snap = mv.runner.stats.snapshot()

    def duration(pair):
        return pb.StatisticDuration(count=pair[0], ns=pair[1])

    stats = pb.ModelStatistics(
        name=mv.name, version=str(mv.version), last_inference=snap["last_inference"],
        inference_count=snap["inference_count"], execution_count=snap["execution_count"],
        inference_stats=pb.InferStatistics(**{k: duration(snap[k]) for k in (
            "success", "fail", "queue", "compute_input", "compute_infer", "compute_output")}),
    )
    for size, times in snap["batches"].items():
        stats.batch_stats.add(batch_size=size, **{k: duration(v) for k, v in times.items()})
    return stats

"""ferry.generate.v1.Generation: decode -> look up -> stream the runner's events -> encode."""

from __future__ import annotations

import contextlib
import time

from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from server.errors import InvalidInputError
from server.generation_runner import GenerationRunner
from server.repository.registry import Registry
from server.rpc.errors import translate_stream_errors
from server.scheduling.sequence import SamplingParams

SERVICE = gen.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationServicer(gen_grpc.GenerationServicer):
    def __init__(self, registry: Registry):
        self.registry = registry

    @translate_stream_errors
    async def Generate(self, request: gen.GenerateRequest, context):
        arrival = time.monotonic_ns()
        mv = self.registry.get(request.model_name, request.model_version)
        runner = mv.runner
        if not isinstance(runner, GenerationRunner):
            raise InvalidInputError(f"model '{mv.name}' is not a generation model (its backend is {mv.config.backend!r})")
        which = request.WhichOneof("prompt")
        prompt = runner.backend.encode_prompt(request.text if which == "text" else None,
                                              list(request.token_ids.ids) if which == "token_ids" else None)
        sampling = _sampling(request.sampling, runner.backend.settings.default_max_tokens)
        deadlines = [arrival + request.timeout_us * 1000] if request.timeout_us else []
        remaining = context.time_remaining()
        if remaining is not None:
            deadlines.append(arrival + int(remaining * 1e9))
        events = runner.generate(prompt, sampling, request.priority, min(deadlines, default=None), arrival)
        async with contextlib.aclosing(events) as events:  # a client gone closes it now, not at garbage collection
            async for event in events:
                yield _response(request.id, event)


def _response(request_id: str, event) -> gen.GenerateResponse:
    response = gen.GenerateResponse(id=request_id, token_ids=event.token_ids, text=event.text)
    if event.finish_reason is not None:
        response.finish_reason = event.finish_reason
        response.usage.prompt_tokens = event.prompt_tokens
        response.usage.completion_tokens = event.completion_tokens
        response.timings.queue_ms = event.queue_ms
        response.timings.time_to_first_token_ms = event.ttft_ms
        response.timings.total_ms = event.total_ms
    return response


def _sampling(p: gen.SamplingParams, default_max_tokens: int) -> SamplingParams:
    if p.temperature < 0 or not 0 <= p.top_p <= 1:
        raise InvalidInputError(f"temperature must be >= 0 and top_p within [0, 1] (got {p.temperature}, {p.top_p})")
    return SamplingParams(
        max_tokens=p.max_tokens or default_max_tokens, temperature=p.temperature, top_k=p.top_k,
        top_p=p.top_p if p.top_p > 0 else 1.0, seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
    )


def generation_service(servicer: GenerationServicer):
    return servicer, gen_grpc.add_GenerationServicer_to_server, SERVICE

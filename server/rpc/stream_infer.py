"""ModelStreamInfer, Triton's bidirectional stream: many requests in, their responses out.

Requests to ordinary models are answered exactly once each, in the order they arrived on the stream
(while they run concurrently, so they still batch). Requests to generation models (decoupled, as
Triton's vLLM backend) follow that backend's tensor conventions: `text_input`, optional `stream`,
`sampling_parameters` (JSON), `exclude_input_in_output`, `max_tokens`; each response carries
`text_output` and `triton_final_response`. Errors go back as `error_message` and the stream goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator, Awaitable, Callable

import numpy as np

from protos import grpc_service_pb2 as pb
from server.errors import FerryError, InvalidInputError
from server.names import capped
from server.generation_runner import GenerationRunner
from server.repository.registry import ModelVersion, Registry
from server.rpc import codec
from server.rpc.passthrough import Undecodable
from server.scheduling.sequence import SamplingParams

InferOne = Callable[[pb.ModelInferRequest, ModelVersion, int], Awaitable[pb.ModelInferResponse]]
_SAMPLING_KEYS = {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos"}


async def stream_infer(registry: Registry, requests: AsyncIterator[pb.ModelInferRequest], infer_one: InferOne,
                       deadline_ns: int | None = None) -> AsyncIterator[pb.ModelStreamInferResponse]:
    """`deadline_ns`: the stream's own gRPC deadline, which bounds every generation on it."""
    out: asyncio.Queue = asyncio.Queue()
    tasks: set[asyncio.Task] = set()
    previous: asyncio.Future | None = None  # the last ordered answer, which the next one waits for

    async def read() -> None:
        nonlocal previous
        try:
            async for request in requests:
                turn = asyncio.get_running_loop().create_future()
                task = asyncio.create_task(_serve(registry, request, infer_one, out, previous, turn, deadline_ns))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                previous = turn
            await asyncio.gather(*list(tasks))
        finally:
            out.put_nowait(None)  # however reading ended, the response side must too

    reader = asyncio.create_task(read())
    try:
        while (response := await out.get()) is not None:
            yield response
    finally:
        reader.cancel()
        for task in list(tasks):
            task.cancel()


async def _serve(registry, request, infer_one, out, previous, turn, deadline_ns) -> None:
    arrival = time.monotonic_ns()
    try:
        if isinstance(request, Undecodable):  # a message that did not parse: answered here, the stream goes on
            raise request.error
        mv = registry.get(request.model_name, request.model_version)
        if isinstance(mv.runner, GenerationRunner):
            turn.set_result(None)  # decoupled: its responses interleave freely with the others
            async with contextlib.aclosing(_generate(request, mv, deadline_ns)) as responses:
                async for response in responses:
                    out.put_nowait(pb.ModelStreamInferResponse(infer_response=response))
            return
        response = pb.ModelStreamInferResponse(infer_response=await infer_one(request, mv, arrival))
        _final(response.infer_response, True)
    except Exception as exc:  # noqa: BLE001 - one request's failure is reported on the stream, which goes on
        message = capped(exc.message if isinstance(exc, FerryError) else f"internal error: {type(exc).__name__}: {exc}")
        failed = _final(pb.ModelInferResponse(id=request.id, model_name=request.model_name), True)
        response = pb.ModelStreamInferResponse(error_message=message, infer_response=failed)
    if previous is not None:
        await previous
    out.put_nowait(response)
    if not turn.done():
        turn.set_result(None)


def _final(response: pb.ModelInferResponse, final: bool) -> pb.ModelInferResponse:
    response.parameters["triton_final_response"].bool_param = final
    return response


async def _generate(request: pb.ModelInferRequest, mv: ModelVersion, deadline_ns: int | None) -> AsyncIterator[pb.ModelInferResponse]:
    runner: GenerationRunner = mv.runner
    inputs = codec.decode_inputs(request)
    text = _scalar(inputs, "text_input")
    if text is None:
        raise InvalidInputError(f"generation model '{mv.name}' needs a BYTES input 'text_input' with the prompt")
    prompt_text = text.decode() if isinstance(text, bytes) else str(text)
    streaming = bool(_scalar(inputs, "stream", False))
    exclude = _scalar(inputs, "exclude_input_in_output", None)
    if exclude is None:
        exclude = streaming  # Triton's vLLM backend: non-streamed answers include the prompt
    if streaming and not exclude:
        raise InvalidInputError("exclude_input_in_output=false cannot be used with stream=true")
    params = codec.decode_parameters(request.parameters)
    sampling = _sampling(inputs, params, runner.backend.settings.default_max_tokens)
    prompt = runner.backend.encode_prompt(prompt_text, None)
    arrival = time.monotonic_ns()
    timeout_us, priority = params.get("timeout"), params.get("priority")
    deadlines = [d for d in (deadline_ns, arrival + timeout_us * 1000 if timeout_us else None) if d is not None]
    pieces = [] if exclude else [prompt_text]
    events = runner.generate(prompt, sampling, int(priority or 0), min(deadlines, default=None), arrival)
    async with contextlib.aclosing(events) as events:
        async for event in events:
            final = event.finish_reason is not None
            if streaming:
                yield _text_response(request, mv, event.text, final, event.finish_reason)
            else:
                pieces.append(event.text)
                if final:
                    yield _text_response(request, mv, "".join(pieces), True, event.finish_reason)


def _text_response(request, mv: ModelVersion, text: str, final: bool, reason: str | None) -> pb.ModelInferResponse:
    response = codec.encode_response(request, mv.version, {"text_output": np.array([text.encode()], dtype=object)},
                                     ("text_output",))
    if reason:
        response.parameters["finish_reason"].string_param = reason
    return _final(response, final)


def _scalar(inputs: dict[str, np.ndarray], name: str, default=None):
    value = inputs.get(name)
    return default if value is None or value.size == 0 else value.reshape(-1)[0]


def _sampling(inputs: dict[str, np.ndarray], params: dict, default_max_tokens: int) -> SamplingParams:
    """vLLM's JSON `sampling_parameters`, else the request-level parameters; `max_tokens` tensor wins."""
    raw = _scalar(inputs, "sampling_parameters")
    try:
        given = json.loads(raw) if raw is not None else {k: v for k, v in params.items() if k in _SAMPLING_KEYS}
    except ValueError as exc:
        raise InvalidInputError(f"sampling_parameters is not valid JSON: {exc}") from None
    unknown = set(given) - _SAMPLING_KEYS
    if unknown:
        raise InvalidInputError(f"unsupported sampling parameters {capped(str(sorted(unknown)), 300)}; supported: {sorted(_SAMPLING_KEYS)}")
    if "max_tokens" in inputs:
        given["max_tokens"] = int(_scalar(inputs, "max_tokens"))
    stop = given.get("stop") or ()
    return SamplingParams(
        max_tokens=int(given.get("max_tokens") or default_max_tokens), temperature=float(given.get("temperature", 0.0)),
        top_k=int(given.get("top_k", 0)), top_p=float(given.get("top_p", 1.0)) or 1.0,
        seed=int(given["seed"]) if given.get("seed") is not None else None,
        stop=(stop,) if isinstance(stop, str) else tuple(stop), stop_token_ids=tuple(given.get("stop_token_ids") or ()),
        ignore_eos=bool(given.get("ignore_eos", False)),
    )

"""What a Python model process asks of the server: BLS requests, model control, metrics, restarts.

A BLS request (`pb_utils.InferenceRequest(...).exec()`) arrives on the model process's reader thread
and runs here on the event loop, through the called model's own runner, found through the registry
at call time as an ensemble's steps are: so it is batched with everyone else's traffic to that model,
counted in its statistics, and held to its queue policy. The answer (or the error, as a Triton error
code and message, with the response's parameters) goes back over the link. A decoupled model called
with `exec(decoupled=True)` streams its responses back one by one; a batching model called that way
answers once; a generation model's call is read as ModelStreamInfer reads Triton's vLLM tensors
(runners/generation_tensors.py) and run by its own runner. Each call is a task whose future the model
process holds: cancelling it (the callers of the request that made it left) cancels the call where it is.
A call made while a traced request executes is traced as that request's child (`parent_id`), as an
ensemble step is: REQUEST_START here, the called runner's own timestamps, REQUEST_END once answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from concurrent.futures import Future
from typing import Callable

import numpy as np

from server.backends.python import protocol as p
from server.observability.custom_metrics import CustomMetrics
from server.errors import (AlreadyExistsError, FerryError, InvalidInputError, ModelNotFoundError,
                           ModelUnavailableError, QueueFullError, RequestCancelledError, UnknownError,
                           UnsupportedError)
from server.observability.metrics import ModelProcessRestarts
from server.observability.tracing.doors import GenerationTrace
from server.observability.tracing.record import TENSOR_BACKEND_OUTPUT, TENSOR_QUEUE_INPUT, call_trace, ended
from server.request import InferRequest, is_final, parameters_of
from server.runners.sequence_inputs import FLAG_END, FLAG_START
from server.runners import generation_tensors
from server.runners.base import DECOUPLED, GENERATE
from server.runners.ensemble import LateLookup

log = logging.getLogger(__name__)
_CANCELLED = "the request that made this BLS call was cancelled"
Answer = Callable[..., None]  # answer(outputs=None, error=None, final=True, parameters=None)
_CODES = [(InvalidInputError, p.INVALID_ARG), (ModelNotFoundError, p.NOT_FOUND), (QueueFullError, p.UNAVAILABLE),
          (ModelUnavailableError, p.UNAVAILABLE), (UnsupportedError, p.UNSUPPORTED),
          (AlreadyExistsError, p.ALREADY_EXISTS), (UnknownError, p.UNKNOWN), (RequestCancelledError, p.CANCELLED)]


class LateControl:
    """The server's model control (server/doors/model_control.py), bound once the registry exists: pb_utils.load_model
    and unload_model go through it, so model code meets the same mode and upload rules as a client does."""

    def __init__(self):
        self.control = None

    def bind(self, control) -> None:
        self.control = control


class ModelCalls:
    def __init__(self, loop: asyncio.AbstractEventLoop, lookup: LateLookup, control: LateControl,
                 restarts: ModelProcessRestarts | None, custom: CustomMetrics | None):
        self.loop, self.lookup, self.control_ = loop, lookup, control
        self.restarts, self.custom = restarts, custom

    def call(self, call: p.Call, inputs: dict[str, np.ndarray], answer: Answer, deadline_ns: int | None = None,
             parent=None) -> Future:
        """`deadline_ns`: the calling requests' deadline, which the call inherits (with its own timeout);
        `parent`: the calling request's trace, when it is traced. Cancelling the returned future (the
        callers of the request that made it left) cancels the call in the called model's runner (a queued
        request never runs, a generation stops) and answers it CANCELLED."""
        held: list[InferRequest] = []  # the call's request while it runs (emptied once answered)
        running = asyncio.run_coroutine_threadsafe(self._call(call, inputs, answer, deadline_ns, parent, held), self.loop)
        running.add_done_callback(lambda done: done.cancelled() and answer(None, (p.CANCELLED, _CANCELLED), True))
        # A weak reference: the future holding a function that holds the future would be a cycle, which only
        # the cycle collector frees, and the server runs it rarely (server/heap.py): each call's request,
        # with its input and output tensors, stayed alive that long (Triton's bls_memory: gigabytes).
        ref = weakref.ref(running)
        running.cancel_request = lambda: self.loop.call_soon_threadsafe(_cancel_request, ref, held)
        return running

    async def _call(self, call: p.Call, inputs: dict[str, np.ndarray], answer: Answer, deadline_ns: int | None,
                    parent, held: list) -> None:
        lease = getattr(self.lookup, "lease", None)  # on-demand model control: a cold model loads first
        try:
            async with contextlib.nullcontext() if lease is None else lease(call.model, deadline_ns):
                await self._call_leased(call, inputs, answer, deadline_ns, parent, held)
        except FerryError as exc:  # its model's load failed, did not fit the budget, or outlasted the deadline
            answer(None, (code_of(exc), exc.message), True)
        finally:
            held.clear()  # answered: whoever still holds the future holds no tensors

    async def _call_leased(self, call: p.Call, inputs: dict[str, np.ndarray], answer: Answer, deadline_ns: int | None,
                           parent, held: list) -> None:
        trace, error = None, None
        try:
            with _refused_as_triton(call.model):
                model = self.lookup(call.model, call.version)
            if parent is not None:  # the calling request is traced: this call is its child
                trace = call_trace(parent, model.name, model.runner.version, call.request_id,
                                   started=model.runner.serves != GENERATE)
            if model.runner.serves == GENERATE:
                await _generate(model, call, inputs, answer, deadline_ns, trace)
                return
            with _refused_as_triton(call.model):
                request = _request(model, call, inputs, deadline_ns)
            request.trace = trace
            held.append(request)
            _traced(trace, TENSOR_QUEUE_INPUT, request.inputs)
            del inputs
            if model.runner.serves == DECOUPLED:
                if not call.decoupled:
                    raise InvalidInputError(f"model '{call.model}' is decoupled: call it with exec(decoupled=True)")
                final = False
                async for outputs in model.runner.stream(request):
                    final = is_final(outputs)  # the final flag came with it: no empty last response (Triton's)
                    answer(_wanted(outputs, call), None, final, parameters_of(outputs))
                if not final:
                    answer(None, None, True)
                return
            outputs = await model.runner.infer(request)
            _traced(trace, TENSOR_BACKEND_OUTPUT, outputs)
            # exec(decoupled=True) too: a model that is not decoupled sends its one response with the final
            # flag, so the iterator has that response and no empty last one (Triton's bls tests rely on it)
            answer(_wanted(outputs, call), None, True, parameters_of(outputs))
        except FerryError as exc:
            error = exc.message
            answer(None, (code_of(exc), exc.message), True)
        except asyncio.CancelledError:
            error = _CANCELLED
            raise
        except Exception as exc:  # the caller must hear back whatever went wrong here
            log.exception("BLS call to model '%s' failed unexpectedly", call.model)
            error = f"{type(exc).__name__}: {exc}"
            answer(None, (p.INTERNAL, error), True)
        finally:
            if trace is not None:
                ended(trace, error)

    def control(self, op: str, name: str, version: str, config: str, files: dict, answer: Answer) -> Future:
        return asyncio.run_coroutine_threadsafe(self._control(op, name, version, config, files, answer), self.loop)

    async def _control(self, op: str, name: str, version: str, config: str, files: dict, answer: Answer) -> None:
        try:
            answer(None, None, True, {"value": await self._controlled(op, name, version, config, files)})
        except FerryError as exc:
            answer(None, (code_of(exc), exc.message), True)

    async def _controlled(self, op: str, name: str, version: str, config: str, files: dict) -> bool:
        if op == "ready":
            try:
                self.lookup(name, version)
            except FerryError:
                return False
            return True
        control = self.control_.control
        if control is None:
            raise ModelUnavailableError("the server is starting")
        if op == "load":  # the LoadModel RPC's own path: the same mode, upload flag and inline-file checks
            await control.load(name, {**({"config": config} if config else {}), **files})
        else:
            await control.unload(name)
        return True

    def metric(self, model: str, version: int, update: tuple) -> None:
        if self.custom is not None:
            self.custom.update(model, *update)

    def restarted(self, model: str, version: int) -> None:
        if self.restarts is not None:
            self.restarts.restarted(model, version)


@contextlib.contextmanager
def _refused_as_triton(model: str):
    """A call refused before it reaches the model (no such model, not ready, inputs that do not fit) is
    worded as Triton's request executor words it, `Model <name> - Error when running inference: <why>`:
    model code written for Triton tells these apart from the model's own errors by that prefix."""
    try:
        yield
    except FerryError as exc:  # a new error of the same class (its status), not the one a registry may keep
        refused = type(exc).__new__(type(exc))
        refused.__dict__.update(exc.__dict__)
        FerryError.__init__(refused, f"Model {model} - Error when running inference: {exc.message}")
        raise refused from exc


def _cancel_request(ref: weakref.ref, held: list) -> None:
    """On the loop: the caller cancelled its decoupled call (the response iterator's cancel()). As in Triton,
    the called request is cancelled, not abandoned: the responses its model still sends reach the caller
    (a model that honours the cancellation ends with CANCELLED). Where the runner has no such
    cancellation (a model that is not decoupled, a generation), the call is cancelled outright."""
    cancel = held[0].cancel if held else None
    if cancel is not None:
        cancel()
    elif (running := ref()) is not None:
        running.cancel()


def code_of(exc: FerryError) -> int:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return p.INTERNAL


def _traced(trace, activity: str, tensors: dict[str, np.ndarray]) -> None:
    """Level TENSORS: a call's inputs and outputs in its own trace, as an ensemble step's are."""
    if trace is not None:
        trace.tensor(activity, tensors)


def _wanted(outputs: dict[str, np.ndarray], call: p.Call) -> dict[str, np.ndarray]:
    return {name: outputs[name] for name in call.requested if name in outputs} if call.requested else dict(outputs)


async def _generate(model, call: p.Call, inputs: dict[str, np.ndarray], answer: Answer, inherited_ns: int | None,
                    trace) -> None:
    """A call to a generation model, read as ModelStreamInfer reads Triton's vLLM tensors and run by the
    model's own runner: `exec()` gets the whole text, `exec(decoupled=True)` one answer per piece when
    `stream` is true (else one), then the final empty one. The finish reason rides as a response parameter.
    `trace`: the call's, when traced: a generation's timestamps (FIRST_TOKEN, one per token), as a stream's."""
    if call.requested:
        model.signature.check_outputs(call.requested)
    arrival = time.monotonic_ns()
    read = generation_tensors.read(call.model, inputs, call.parameters, arrival, inherited_ns, call.timeout_us)
    observe = None
    if trace is not None:
        def observe(decoded):
            generation = GenerationTrace(trace, arrival, stream=True)
            generation.started(trace.model_version, trace.request_id, decoded.sampling)
            return generation.event

    async with contextlib.aclosing(generation_tensors.answers(
            model.runner, read if call.decoupled else generation_tensors.whole(read), observe)) as answers:
        async for text in answers:
            params = {"finish_reason": text.finish_reason} if text.finish_reason else None
            answer(_wanted(text.outputs, call), None, not call.decoupled, params)
    if call.decoupled:
        answer(None, None, True)


def _request(model, call: p.Call, inputs: dict[str, np.ndarray], inherited_ns: int | None) -> InferRequest:
    """As a client's request to `model` would be checked (names, shapes, datatypes, requested outputs)."""
    batch_size, key = model.signature.check_inputs(inputs)
    if call.requested:
        model.signature.check_outputs(call.requested)
    now = time.monotonic_ns()
    params = dict(call.parameters)
    if call.correlation_id:  # a stateful model's sequence, as a client's sequence parameters give it
        params.setdefault("sequence_id", call.correlation_id)
        params.setdefault("sequence_start", bool(call.flags & FLAG_START))
        params.setdefault("sequence_end", bool(call.flags & FLAG_END))
    priority = params.pop("priority", 0) if isinstance(params.get("priority", 0), int) else 0
    deadlines = [d for d in (now + call.timeout_us * 1000 if call.timeout_us else None, inherited_ns) if d is not None]
    return InferRequest(
        model_name=model.name, inputs=inputs, batch_size=batch_size, batch_key=key, id=call.request_id,
        requested_outputs=tuple(call.requested), parameters=params, priority=priority, timeout_us=call.timeout_us,
        deadline_ns=min(deadlines) if deadlines else None, arrival_ns=now,
        length=model.signature.length(inputs), nbytes=sum(a.nbytes for a in inputs.values()),
    )

"""The ensemble runner: a pipeline of models (pre-process -> model -> post-process) served as one.

An ensemble owns no instances and no scheduler. Each step is an ordinary request to the step's own
model, found through the registry when the request runs (so a reloaded step model is picked up and
an unloaded one fails only the requests that need it) and queued on that model's runner, where it
batches with everyone else's requests to the same model. Tensors move between steps by name as the
config's `input_map` / `output_map` say. A step starts as soon as its inputs exist, so independent
branches (two encoders of one input, say) run at the same time and a request costs its longest path,
not the sum of its steps, as in Triton's ensemble scheduler. A failing step fails the request at once,
with the step named; its siblings still queued or running are cancelled (they leave their queues).

A step model with a decoupled transaction policy (0..N responses a request) makes the ensemble
decoupled while it serves, as in Triton: the ensemble then answers streaming calls only, and each
response of such a step forks the rest of the walk with that response's tensors, so every response
that reaches the ensemble's outputs becomes one response of the ensemble (two steps of two responses
each in a chain: four). Forks run at the same time; a failing fork fails the request and cancels the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Callable, Protocol

import numpy as np

from protos import model_config_pb2 as mc
from server import response_cache
from server.errors import BackendError, FerryError, InvalidInputError, ModelUnavailableError
from server.observability.metrics import ModelStats
from server.request import InferRequest
from server.response_cache import ResponseCache
from server.runners.base import DECOUPLED, INFER, Runner, RunnerBase
from server.runners.ensemble_shapes import fit
from server.tensors.signature import Signature
from server.observability.tracing.record import (INFER_RESPONSE_COMPLETE, QUEUE_START, REQUEST_END,
                                                TENSOR_BACKEND_OUTPUT, step_trace)


class StepModel(Protocol):
    """What the registry answers for a step's model (a ModelVersion)."""

    name: str
    signature: Signature
    runner: Runner


Step = mc.ModelEnsembling.Step
StepLookup = Callable[[str, str], StepModel]  # (model name, version or "") -> a ready model, or raises


class LateLookup:
    """The registry's lookup, bound after the registry (which is built with the factory) exists."""

    def __init__(self):
        self._lookup: StepLookup | None = None
        self._lease = None

    def bind(self, lookup: StepLookup, lease=None) -> None:
        """`lease(name, remaining_s)`: what a call holds while it runs (on-demand model control loads a cold
        model first, server/repository/on_demand.py); none: nothing to hold."""
        self._lookup, self._lease = lookup, lease

    def lease(self, name: str, deadline_ns: int | None):
        if self._lease is None:
            return contextlib.nullcontext()
        return self._lease(name, None if deadline_ns is None else max(0.0, (deadline_ns - time.monotonic_ns()) / 1e9))

    def __call__(self, name: str, version: str) -> StepModel:
        if self._lookup is None:
            raise ModelUnavailableError(f"model '{name}' cannot be looked up yet: the server is starting")
        return self._lookup(name, version)


def _lease(lookup, name: str, deadline_ns: int | None):
    lease = getattr(lookup, "lease", None)
    return contextlib.nullcontext() if lease is None else lease(name, deadline_ns)


class EnsembleRunner(RunnerBase):

    def __init__(self, name: str, version: int, config: mc.ModelConfig, order: list[int], lookup: StepLookup,
                 stats: ModelStats, cache: ResponseCache | None = None):
        super().__init__(name, version, stats)
        self._cache = cache  # top-level caching: a hit runs no step (steps may cache on their own too)
        self.steps = [config.ensemble_scheduling.step[i] for i in order]
        self.step_numbers = order  # as written in the config, for messages
        self.outputs = [t.name for t in config.output]
        self.output_dims = {t.name: tuple(t.dims) for t in config.output}
        self.batching = config.max_batch_size > 0
        self.lookup = lookup
        self._in_flight = 0

    @property
    def serves(self) -> str:
        """DECOUPLED while one of the step models serving now is decoupled (its responses fan out, so the
        ensemble's do too), INFER otherwise; read per call, so a reloaded step model changes it."""
        return DECOUPLED if any(self._streaming(step) for step in self.steps) else INFER

    def _streaming(self, step: Step) -> bool:
        try:
            return self.lookup(step.model_name, _version(step)).runner.serves == DECOUPLED
        except FerryError:  # not served now: a call fails naming the step
            return False

    async def infer(self, request: InferRequest) -> dict[str, np.ndarray]:
        self._admit_check()
        scope = self._cache_scope() if self._cache is not None else None
        if scope is not None:
            return await response_cache.answer(self._cache, scope, request, self.stats, self._run_steps)
        return await self._run_steps(request)

    def _cache_scope(self) -> str | None:
        """This load and the loads of the step models serving now, so a step model's reload never lets
        the ensemble answer from entries its old weights made; None while a step model is missing (the
        request then runs, and fails naming the step)."""
        try:
            loads = [self.lookup(step.model_name, _version(step)).runner.load_id for step in self.steps]
        except FerryError:
            return None
        return f"{self.name}\0{self.version}\0{self.load_id}\0{','.join(map(str, loads))}"

    async def _run_steps(self, request: InferRequest) -> dict[str, np.ndarray]:
        self._in_flight += 1
        if request.trace is not None:  # the ensemble scheduler takes it at once (Triton's QUEUE_START)
            request.trace.mark(QUEUE_START)
        try:
            tensors, rows = await self._walk(request)
            if request.trace is not None:  # every output made: the ensemble's one response is complete
                request.trace.mark(INFER_RESPONSE_COMPLETE)
        except FerryError as exc:
            self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=False, reason="BACKEND")
            raise exc
        except asyncio.CancelledError:  # the caller went away; its steps were cancelled with it
            self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=False, reason="CANCELED")
            raise
        finally:
            self._in_flight -= 1
            if not self._accepting:
                self._wake.set()
        self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=True)
        return {name: fit(tensors[name], self.output_dims[name], self.batching, rows[name]) for name in self.outputs}

    async def _walk(self, request: InferRequest) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Every step once, each started when its inputs exist; returns every tensor the steps made, and
        each one's rows (the batch size of the request that made it; 0: made without a batch dimension)."""
        tensors = dict(request.inputs)
        rows = dict.fromkeys(tensors, request.batch_size if self.batching else 0)
        waiting = list(zip(self.step_numbers, self.steps))
        running: dict[asyncio.Future, Step] = {}
        try:
            while waiting or running:
                ready, waiting = _partition(waiting, tensors)
                if len(ready) == 1 and not running:  # a chain's next link: no task needed
                    number, step = ready[0]
                    _keep(step, await self._run_step(number, step, request, tensors, rows), tensors, rows)
                    continue
                for number, step in ready:
                    running[asyncio.ensure_future(self._run_step(number, step, request, tensors, rows))] = step
                finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    _keep(running.pop(task), task.result(), tensors, rows)  # a failed step raises here
        finally:
            await _cancel(running)
        return tensors, rows

    async def _run_step(self, number: int, step: Step, request: InferRequest, tensors: dict[str, np.ndarray],
                        rows: dict[str, int]) -> tuple[dict[str, np.ndarray], int]:
        """The step's outputs, and their rows (the step request's batch size; 0 for a non-batching model)."""
        where = f"ensemble '{self.name}' step {number} (model '{step.model_name}')"
        try:
            async with _lease(self.lookup, step.model_name, request.deadline_ns):  # on demand: a cold step loads
                return await self._call_step(step, request, tensors, rows)
        except FerryError as exc:
            raise type(exc)(f"{where} failed: {exc.message}") from exc

    async def _call_step(self, step: Step, request: InferRequest, tensors: dict[str, np.ndarray],
                         rows: dict[str, int]) -> tuple[dict[str, np.ndarray], int]:
        model = self.lookup(step.model_name, _version(step))
        if model.runner.serves != INFER:
            raise InvalidInputError(f"model '{model.name}' streams its answers and cannot be an ensemble step")
        step_request = _step_request(model, step, request, tensors, rows)
        with _traced(request, model, step_request):
            return _answer(model, step_request, await model.runner.infer(step_request))

    async def stream(self, request: InferRequest) -> AsyncIterator[dict[str, np.ndarray]]:
        """The ensemble's responses when a step is decoupled: one for every fork of the walk that makes the
        ensemble's outputs, as each is made (forks finish in any order)."""
        self._admit_check()
        self._in_flight += 1
        if request.trace is not None:
            request.trace.mark(QUEUE_START)
        made: asyncio.Queue = asyncio.Queue()  # a fork's outputs, a fork's FerryError, or None: a fork ended
        forks: set[asyncio.Task] = set()

        def fork(tensors: dict[str, np.ndarray], rows: dict[str, int], waiting: list[tuple[int, Step]]) -> None:
            task = asyncio.ensure_future(self._fork(request, tensors, rows, waiting, fork, made))
            forks.add(task)
            task.add_done_callback(lambda t: (forks.discard(t), made.put_nowait(None)))

        failure = "CANCELED"
        try:
            fork(dict(request.inputs), dict.fromkeys(request.inputs, request.batch_size if self.batching else 0),
                 list(zip(self.step_numbers, self.steps)))
            while forks or not made.empty():
                item = await made.get()
                if isinstance(item, FerryError):
                    failure = "BACKEND"
                    raise item
                if item is not None:
                    if request.trace is not None:
                        request.trace.mark(INFER_RESPONSE_COMPLETE)
                    yield item
            failure = ""
        finally:
            for task in forks:
                task.cancel()
            if forks:
                await asyncio.gather(*forks, return_exceptions=True)
            self._in_flight -= 1
            if not self._accepting:
                self._wake.set()
            self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=not failure, reason=failure)

    async def _fork(self, request: InferRequest, tensors: dict[str, np.ndarray], rows: dict[str, int],
                    waiting: list[tuple[int, Step]], fork, made: asyncio.Queue) -> None:
        """Walk on from `tensors` until the outputs exist (put on `made`) or a decoupled step answers (each of
        its responses forks what is left); a step's failure is put on `made` for the stream to raise."""
        try:
            while waiting:
                ready, waiting = _partition(waiting, tensors)
                plain = [item for item in ready if not self._streaming(item[1])]
                streamed = [item for item in ready if self._streaming(item[1])]
                answers = await asyncio.gather(*(self._run_step(n, step, request, tensors, rows) for n, step in plain))
                for (_, step), answer in zip(plain, answers):
                    _keep(step, answer, tensors, rows)
                if streamed:  # the first decoupled step answers; the others run again in each fork
                    (number, step), rest = streamed[0], streamed[1:] + waiting
                    async with contextlib.aclosing(self._stream_step(number, step, request, tensors, rows)) as answers:
                        async for answer in answers:
                            branch, branch_rows = dict(tensors), dict(rows)
                            _keep(step, answer, branch, branch_rows,
                                  f"ensemble '{self.name}' step {number} (model '{step.model_name}')")
                            fork(branch, branch_rows, list(rest))
                    return
            made.put_nowait({name: fit(tensors[name], self.output_dims[name], self.batching, rows[name])
                             for name in self.outputs})
        except FerryError as exc:
            made.put_nowait(exc)

    async def _stream_step(self, number: int, step: Step, request: InferRequest, tensors: dict[str, np.ndarray],
                           rows: dict[str, int]) -> AsyncIterator[tuple[dict[str, np.ndarray], int]]:
        """A decoupled step's responses, each with its rows (as `_run_step`'s one answer)."""
        where = f"ensemble '{self.name}' step {number} (model '{step.model_name}')"
        try:
            async with _lease(self.lookup, step.model_name, request.deadline_ns):
                model = self.lookup(step.model_name, _version(step))
                step_request = _step_request(model, step, request, tensors, rows)
                with _traced(request, model, step_request):
                    async with contextlib.aclosing(model.runner.stream(step_request)) as responses:
                        async for outputs in responses:
                            yield _answer(model, step_request, outputs)
        except FerryError as exc:
            raise type(exc)(f"{where} failed: {exc.message}") from exc

    async def _loop(self) -> None:
        """Nothing to schedule: wait for the close, then for the requests still walking their steps."""
        while self._accepting or self._in_flight:
            self._wake.clear()
            await self._wake.wait()

    def _abandon_all(self, error: ModelUnavailableError) -> None:
        """Requests in flight wait on their step models, which answer them however they stop."""


@contextlib.contextmanager
def _traced(request: InferRequest, model: StepModel, step_request: InferRequest):
    """A traced ensemble request's step is traced too (parent_id), and its trace ends however the step does."""
    if request.trace is not None:
        step_request.trace = step_trace(request.trace, model.name, model.runner.version, step_request.inputs)
    try:
        yield
    finally:
        if step_request.trace is not None:
            step_request.trace.mark(REQUEST_END)
            step_request.trace.finish()


def _answer(model: StepModel, step_request: InferRequest, outputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    """A step's outputs (recorded at level TENSORS) with their rows: the step's batch size, 0 without batching."""
    if step_request.trace is not None:
        step_request.trace.tensor(TENSOR_BACKEND_OUTPUT, outputs)
    return outputs, step_request.batch_size if model.signature.batching else 0


def _version(step: Step) -> str:
    return str(step.model_version) if step.model_version > 0 else ""  # "": the latest ready version


def _partition(waiting: list[tuple[int, Step]], tensors: dict[str, np.ndarray]):
    """(steps whose inputs all exist now, the rest), each in config order."""
    ready, rest = [], []
    for item in waiting:
        (ready if all(t in tensors for t in item[1].input_map.values()) else rest).append(item)
    return ready, rest


def _keep(step: Step, answer: tuple[dict[str, np.ndarray], int], tensors: dict[str, np.ndarray],
          rows: dict[str, int], where: str = "") -> None:
    outputs, made_rows = answer
    for step_output, tensor in step.output_map.items():
        if step_output not in outputs:  # a decoupled model may send a response without every output
            raise BackendError(f"{where} sent a response without its output '{step_output}', which the ensemble "
                               f"maps to '{tensor}'")
        tensors[tensor] = outputs[step_output]
        rows[tensor] = made_rows


async def _cancel(running: dict[asyncio.Future, Step]) -> None:
    """Siblings of a failed step, or every step of a cancelled request: their requests leave the step
    models' queues (a batch already running finishes there and its answer is dropped)."""
    for task in running:
        task.cancel()
    if running:
        await asyncio.gather(*running, return_exceptions=True)


def _step_request(model: StepModel, step: Step, request: InferRequest, tensors: dict[str, np.ndarray],
                  rows: dict[str, int]) -> InferRequest:
    inputs = {step_input: _fitted(model, step_input, tensors[tensor], rows[tensor]) for step_input, tensor in step.input_map.items()}
    batch_size, key = model.signature.check_inputs(inputs)
    requested = tuple(step.output_map)
    model.signature.check_outputs(requested)
    return InferRequest(
        model_name=model.name, inputs=inputs, batch_size=batch_size, batch_key=key, id=request.id,
        requested_outputs=requested, parameters=dict(request.parameters), priority=request.priority, timeout_us=request.timeout_us,
        deadline_ns=request.deadline_ns, arrival_ns=time.monotonic_ns(), length=model.signature.length(inputs),
        nbytes=sum(a.nbytes for a in inputs.values()),
    )


def _fitted(model: StepModel, name: str, value: np.ndarray, rows: int) -> np.ndarray:
    """The tensor with the batch dimension the step model expects (see ensemble_shapes)."""
    spec = model.signature.inputs.get(name)
    return value if spec is None else fit(value, spec.dims, model.signature.batching, rows)

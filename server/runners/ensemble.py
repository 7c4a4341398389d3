"""The ensemble runner: a pipeline of models (pre-process -> model -> post-process) served as one.

An ensemble owns no instances and no scheduler. Each step is an ordinary request to the step's own
model, found through the registry when the request runs (so a reloaded step model is picked up and
an unloaded one fails only the requests that need it) and queued on that model's runner, where it
batches with everyone else's requests to the same model. Tensors move between steps by name as the
config's `input_map` / `output_map` say; a failing step fails the request with the step named.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import numpy as np

from protos import model_config_pb2 as mc
from server.errors import FerryError, InvalidInputError, ModelUnavailableError
from server.metrics import ModelStats
from server.request import InferRequest
from server.runners.base import INFER, Runner, RunnerBase
from server.signature import Signature


class StepModel(Protocol):
    """What the registry answers for a step's model (a ModelVersion)."""

    name: str
    signature: Signature
    runner: Runner


StepLookup = Callable[[str, str], StepModel]  # (model name, version or "") -> a ready model, or raises


class LateLookup:
    """The registry's lookup, bound after the registry (which is built with the factory) exists."""

    def __init__(self):
        self._lookup: StepLookup | None = None

    def bind(self, lookup: StepLookup) -> None:
        self._lookup = lookup

    def __call__(self, name: str, version: str) -> StepModel:
        if self._lookup is None:
            raise ModelUnavailableError(f"model '{name}' cannot be looked up yet: the server is starting")
        return self._lookup(name, version)


class EnsembleRunner(RunnerBase):
    serves = INFER

    def __init__(self, name: str, version: int, config: mc.ModelConfig, order: list[int], lookup: StepLookup,
                 stats: ModelStats):
        super().__init__(name, version, stats)
        self.steps = [config.ensemble_scheduling.step[i] for i in order]
        self.step_numbers = order  # as written in the config, for messages
        self.outputs = [t.name for t in config.output]
        self.lookup = lookup
        self._in_flight = 0

    async def infer(self, request: InferRequest) -> dict[str, np.ndarray]:
        self._admit_check()
        self._in_flight += 1
        try:
            tensors = dict(request.inputs)
            for number, step in zip(self.step_numbers, self.steps):
                outputs = await self._run_step(number, step, request, tensors)
                for step_output, tensor in step.output_map.items():
                    tensors[tensor] = outputs[step_output]
        except FerryError as exc:
            self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=False, reason="BACKEND")
            raise exc
        finally:
            self._in_flight -= 1
            if not self._accepting:
                self._wake.set()
        self.stats.record_done(time.monotonic_ns() - request.arrival_ns, ok=True)
        return {name: tensors[name] for name in self.outputs}

    async def _run_step(self, number: int, step: mc.ModelEnsembling.Step, request: InferRequest,
                        tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        where = f"ensemble '{self.name}' step {number} (model '{step.model_name}')"
        try:
            model = self.lookup(step.model_name, str(step.model_version) if step.model_version > 0 else "")
            if model.runner.serves != INFER:
                raise InvalidInputError(f"model '{model.name}' streams its answers and cannot be an ensemble step")
            return await model.runner.infer(_step_request(model, step, request, tensors))
        except FerryError as exc:
            raise type(exc)(f"{where} failed: {exc.message}") from exc

    async def _loop(self) -> None:
        """Nothing to schedule: wait for the close, then for the requests still walking their steps."""
        while self._accepting or self._in_flight:
            self._wake.clear()
            await self._wake.wait()

    def _abandon_all(self, error: ModelUnavailableError) -> None:
        """Requests in flight wait on their step models, which answer them however they stop."""


def _step_request(model: StepModel, step: mc.ModelEnsembling.Step, request: InferRequest,
                  tensors: dict[str, np.ndarray]) -> InferRequest:
    inputs = {step_input: tensors[tensor] for step_input, tensor in step.input_map.items()}
    batch_size, key = model.signature.check_inputs(inputs)
    requested = tuple(step.output_map)
    model.signature.check_outputs(requested)
    return InferRequest(
        model_name=model.name, inputs=inputs, batch_size=batch_size, batch_key=key, id=request.id,
        requested_outputs=requested, priority=request.priority, timeout_us=request.timeout_us,
        deadline_ns=request.deadline_ns, arrival_ns=time.monotonic_ns(), length=model.signature.length(inputs),
        nbytes=sum(a.nbytes for a in inputs.values()),
    )

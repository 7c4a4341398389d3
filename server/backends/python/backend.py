"""Python backend: a `model.py` in the version folder, run in a process of its own per instance.

Two faces, one backend (server/backends/python/faces.py): Triton's `class TritonPythonModel` with
`import triton_python_backend_utils as pb_utils`, and Ferry's short `class Model` whose `execute`
takes and returns dicts of arrays. Each instance is one model process (process.py, child.py), so a
model that spins in pure Python, crashes or hangs costs only its own requests: the instance thread
here blocks on the process's answer with the GIL released; a dead process fails its in-flight
requests UNAVAILABLE with the cause and is started again (initialize runs again) on the next call,
counted in `ferry_model_process_restarts_total`.

Triton's execute gets the batch's requests, each with its own tensors, and answers each alone
(`per_request`: the worker calls `execute_requests`); Ferry's `class Model` gets them joined along
dim 0, one call per batch, as before. Every load starts fresh processes, so an edited model.py takes
effect on RepositoryModelLoad or a repository poll.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path

import numpy as np
from google.protobuf import json_format

from protos import model_config_pb2 as mc
from server.backends import nvidia
from server.backends.base import NOT_RUN, STREAM_END, Backend, Device, parameter
from server.backends.python import priority
from server.backends.python import protocol as p
from server.backends.python.faces import defines_auto_complete
from server.backends.python.process import ModelProcess, ProcessDied
from server.config_json import config_json
from server.errors import (AlreadyExistsError, BackendError, ConfigError, FerryError, InvalidInputError,
                           ModelNotFoundError, ModelUnavailableError, RequestCancelledError, UnknownError,
                           UnsupportedError)
from server.request import RESCHEDULED, InferRequest, Outputs

log = logging.getLogger(__name__)
ARENA_BYTES = 32 << 20  # per instance; a tensor that does not fit travels inline in its frame
READY_CHECK_S = 5.0  # as Triton: an is_ready() that takes longer answers "not ready"
# A train (several executes of a model that does not batch, sent in one frame) holds its first request's
# answer until its last execute is done: so it only carries what the process runs in this long.
TRAIN_NS = 1_000_000
TRAIN_PARAMETER = "FERRY_TRAIN_US"
MAX_TRAIN = 16
# While the event loop is the bottleneck, a free instance waits up to this long for a longer train
# (server/scheduling/train_hold.py); FERRY_TRAIN_HOLD_US changes it, 0 turns it off.
TRAIN_HOLD_NS = 6_000_000
TRAIN_HOLD_PARAMETER = "FERRY_TRAIN_HOLD_US"
FINALIZE_S = 10.0  # how long an unloaded model's finalize() may take before its process is killed
# pb_utils.TritonError codes as Triton answers them (INTERNAL, and a code Triton does not know: INTERNAL)
_ERRORS = {p.INVALID_ARG: InvalidInputError, p.NOT_FOUND: ModelNotFoundError, p.UNAVAILABLE: ModelUnavailableError,
           p.UNSUPPORTED: UnsupportedError, p.ALREADY_EXISTS: AlreadyExistsError, p.UNKNOWN: UnknownError,
           p.CANCELLED: RequestCancelledError}


class PythonBackend(Backend):
    name = "python"
    default_filename = "model.py"
    takes_bf16 = True  # model code sees torch.bfloat16 through to_dlpack, as in Triton

    def __init__(self, config: mc.ModelConfig, model_path: Path, device: Device):
        super().__init__(config, model_path, device)
        self.process: ModelProcess | None = None
        self.face = ""
        self.calls = None  # the server's side of BLS, model control and metrics (server/runners/model_calls.py)
        self._restart_lock = threading.Lock()
        self._in_flight = 0  # calls sent and not answered: unloading with some kills rather than waits for finalize
        self._train_budget = TRAIN_NS  # how long a train may run in the process (FERRY_TRAIN_US)
        self._train_ns = 0  # that, where this model may have trains (train_limit); 0: none
        self._hold_ns = TRAIN_HOLD_NS  # how long a free instance may wait for a longer train (FERRY_TRAIN_HOLD_US)

    @property
    def per_request(self) -> bool:
        return self.face == p.TRITON


    @classmethod
    def cuda_devices(cls) -> int:
        """GPUs the NVIDIA driver reports (model code may use them; Ferry imports no CUDA library for it)."""
        return nvidia.gpu_count()

    @classmethod
    def complete_config(cls, config: mc.ModelConfig, model_path: Path, default_max_batch_size: int) -> None:
        """Triton's auto_complete_config, run in a short-lived process of its own (as Triton does)."""
        if not model_path.is_file() or not defines_auto_complete(model_path):
            return
        process = ModelProcess(config.name, 0, 0, lambda: None)
        process.start()
        try:
            answer = process.ask(p.AUTO, str(model_path), json.dumps(config_json(config)))
        except ProcessDied as exc:
            raise ConfigError(f"{config.name}: auto_complete_config: {exc}") from exc
        finally:
            process.stop(FINALIZE_S)
        if answer[0] == p.FAILED:
            raise ConfigError(f"{config.name}: auto_complete_config failed: {answer[1]}")
        completed = mc.ModelConfig()
        try:
            json_format.ParseDict(json.loads(answer[1]), completed)
        except json_format.ParseError as exc:
            raise ConfigError(f"{config.name}: auto_complete_config returned a config Ferry cannot read: {exc}") from exc
        config.CopyFrom(completed)

    def load(self) -> None:
        if parameter(self.config, "EXECUTION_ENV_PATH") is not None:
            raise ConfigError(f"model '{self.config.name}': parameter EXECUTION_ENV_PATH (a conda-pack environment) is "
                              "not supported: Ferry runs model.py with the server's own Python; install the model's "
                              "packages there instead")
        if (parameter(self.config, "FORCE_CPU_ONLY_INPUT_TENSORS") or "yes").lower() in ("no", "false", "off"):
            # Triton hands host tensors anyway where the inputs are on the host (always here): is_cpu() is true
            log.info("model '%s': FORCE_CPU_ONLY_INPUT_TENSORS is 'no': its input tensors are on the host "
                     "(Tensor.is_cpu() is true; to_dlpack() shares them)", self.config.name)
        self.priority = priority.Priority(self.config.name, priority.parse(self.config.name,
                                                                           parameter(self.config, priority.PARAMETER)))
        self._train_budget = self._microseconds(TRAIN_PARAMETER, TRAIN_NS, "0: no trains")
        self._hold_ns = self._microseconds(TRAIN_HOLD_PARAMETER, TRAIN_HOLD_NS, "0: no waiting for longer trains")
        self.process = self._start()

    def _start(self) -> ModelProcess:
        process = ModelProcess(self.config.name, self.version, ARENA_BYTES, lambda: self.calls)
        process.start()
        self.priority.started(process)
        try:
            answer = process.ask(p.INIT, self._args())
        except ProcessDied as exc:
            process.kill()
            raise ModelUnavailableError(f"model '{self.config.name}': {exc} during initialize") from exc
        if process.arena is not None:
            process.arena.unlink()  # both processes map it now: nothing is left in /dev/shm whatever happens
        if answer[0] == p.FAILED:
            process.stop(0)
            raise ConfigError(f"model '{self.config.name}' failed to initialize: {answer[1]}")
        self.face, self.checks_ready = answer[1], answer[2]
        trains = (self.face == p.TRITON and self.config.max_batch_size == 0 and not self.config.HasField("sequence_batching")
                  and not self.config.model_transaction_policy.decoupled)
        self._train_ns = self._train_budget if trains else 0
        return process

    def _microseconds(self, name: str, default_ns: int, zero: str) -> int:
        """A parameter in whole microseconds >= 0 (FERRY_TRAIN_US, FERRY_TRAIN_HOLD_US), in ns; refused at load
        when it is anything else."""
        text = parameter(self.config, name)
        if text is None:
            return default_ns
        try:
            us = int(text)
        except ValueError:
            us = -1
        if us < 0:
            raise ConfigError(f"model '{self.config.name}': parameter {name} must be a whole number of "
                              f"microseconds >= 0 ({zero}), got {text!r}")
        return us * 1000

    @property
    def _version_dir(self) -> Path:
        """The model's version folder: model.py's own, except for a Python-based backend's shared model.py."""
        return self.version_dir or self.model_path.parent

    @property
    def version(self) -> int:
        return int(self._version_dir.name) if self._version_dir.name.isdigit() else 0

    def _args(self) -> dict:
        config = config_json(self.config)
        return {
            "model_config": json.dumps(config), "model_instance_kind": "GPU" if self.device.kind == "cuda" else "CPU",
            "model_instance_device_id": str(self.device.index),
            "model_instance_name": self.instance_name or f"{self.config.name}_0_{self.instance}",
            "model_repository": str(self._version_dir.parent), "model_version": str(self.version),
            "model_name": self.config.name,
            "ferry_model_path": str(self.model_path), "ferry_config": config, "ferry_version_dir": str(self._version_dir),
            "ferry_device": str(self.device), "ferry_instance": self.instance,
        }

    def _alive(self) -> ModelProcess:
        """The model's process, started again if it died since the last call."""
        with self._restart_lock:
            if self.process is None or self.process.death is not None:
                cause = self.process.death if self.process is not None else "it was not running"
                self.process = self._start()
                log.warning("model '%s': started a new model process (pid %d): %s", self.config.name,
                            self.process.pid, cause)
                if self.calls is not None:
                    self.calls.restarted(self.config.name, self.version)
            return self.process

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Ferry's `class Model`: the batch joined, one execute."""
        process = self._alive()
        request = ("", [process.put(n, a) for n, a in inputs.items()], (), {}, 0, 0, 0)  # a p.Request, as it travels
        del inputs
        reply = self._ask(process, [request])
        if isinstance(reply[0], FerryError):
            raise reply[0]
        return reply[0]

    def execute_requests(self, requests: list[InferRequest],
                         inputs: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray] | FerryError]:
        """Triton's execute: the batch's requests as they came, one answer (or error) each."""
        process = self._alive()
        sent = [self._request(process, r, i) for r, i in zip(requests, inputs)]
        del inputs
        return self._ask(process, sent, _deadline(requests), requests)

    def can_send(self) -> bool:
        """Whether `send_requests` may be used now: the process is up, idle and read by the loop (else the
        instance thread takes the batch, starting a new process first if it must). One batch at a time per
        instance, as for every backend: the next waits in the model's queue, where deadlines, priorities
        and cancellation still reach it."""
        process = self.process
        if process is None or process.death is not None or self._in_flight:
            return False
        if not process.on_loop:  # the first batches go through the instance thread while the loop takes over
            process.hand_over(asyncio.get_running_loop())
            return False
        return True

    def send_requests(self, requests: list[InferRequest], inputs: list[dict[str, np.ndarray]], answered) -> None:
        """On the event loop: send the batch's requests (tensors written once into the arena) and return;
        `answered([outputs | FerryError])` is called on the process's reader thread."""
        process = self.process
        sent = [self._request(process, r, i) for r, i in zip(requests, inputs)]
        self._in_flight += 1

        def replied(replies) -> None:
            self._in_flight -= 1
            if isinstance(replies, ProcessDied):
                answered([ModelUnavailableError(str(replies))] * len(sent))
            else:
                answered([self._outputs(process, reply) for reply in replies])
                self.priority.answered()

        process.send(p.EXEC, sent, replied, _deadline(requests), requests)

    def train_limit(self) -> int:
        """How many queued requests of a model that does not batch (max_batch_size 0, Triton's face) may go
        to its process in one frame, each run by its own execute as Triton runs them: as many as
        its measured executes fill TRAIN_NS, at most MAX_TRAIN; 1 before the first is measured, for any
        other model, and where the batch is not sent from the loop."""
        process = self.process
        if not self._train_ns or process is None:
            return 1
        took = process.execute_ns
        return max(1, min(MAX_TRAIN, self._train_ns // took)) if took else 1

    def train_hold_ns(self) -> int:
        return self._hold_ns if self._train_ns else 0

    def execute_ns(self) -> int:
        process = self.process
        return process.execute_ns if process is not None else 0

    def send_train(self, requests: list[InferRequest], inputs: list[dict[str, np.ndarray]], answered) -> None:
        """`send_requests` for a train: each request its own execute, all in one frame."""
        process = self.process
        sent = [self._request(process, r, i) for r, i in zip(requests, inputs)]
        self._in_flight += 1

        def replied(replies: list) -> None:
            """A process that died in a train ran its executes in order: the first without an answer was
            running (it fails, as a request alone would), the ones after it never began (NOT_RUN: the
            worker runs them on the next process)."""
            self._in_flight -= 1
            answers, died = [], False
            for reply in replies:
                if isinstance(reply, ProcessDied):
                    answers.append(NOT_RUN if died else ModelUnavailableError(str(reply)))
                    died = True
                else:
                    answers.append(self._outputs(process, reply))
            answered(answers)
            self.priority.answered()

        process.send_train(sent, replied, requests)

    def send_joined(self, inputs: dict[str, np.ndarray], answered) -> None:
        """`send_requests` for Ferry's `class Model`: the batch joined, one execute; `answered(outputs or
        error)`."""
        process = self.process
        request = ("", [process.put(n, a) for n, a in inputs.items()], (), {}, 0, 0, 0)  # a p.Request, as it travels
        self._in_flight += 1

        def replied(replies) -> None:
            self._in_flight -= 1
            answered(ModelUnavailableError(str(replies)) if isinstance(replies, ProcessDied)
                     else self._outputs(process, replies[0]))
            self.priority.answered()

        process.send(p.EXEC, [request], replied)

    def _ask(self, process: ModelProcess, sent: list[tuple], deadline_ns: int | None = None,
             callers: list[InferRequest] = ()) -> list:
        self._in_flight += 1
        try:
            replies = process.ask(p.EXEC, sent, deadline_ns=deadline_ns, callers=callers)
        except ProcessDied as exc:
            return [ModelUnavailableError(str(exc))] * len(sent)
        finally:
            self._in_flight -= 1
        self.priority.answered()
        return [self._outputs(process, reply) for reply in replies]

    def opens_on_loop(self) -> bool:
        """Whether `open_streams` may be called on the event loop now: the process is up and read by the
        loop (else the instance's thread opens, starting a new process first if it must)."""
        process = self.process
        return process is not None and process.death is None and process.on_loop

    def open_streams(self, requests: list[InferRequest], delivers: list, executed) -> list[_Stream]:
        """Decoupled requests, run by one execute in the model process (started first if it must be: call
        this on the instance's thread). `deliver(outputs | FerryError | STREAM_END)` gets its request's
        responses; `executed()` is called for each request once the execute has returned (the instance
        may take its next batch while responses still come, as in Triton); both on the reader thread or
        the event loop. Cancel each with its handle."""
        process = self._alive()
        streams = [_Stream(self, process, r, deliver, executed) for r, deliver in zip(requests, delivers)]
        self._in_flight += len(streams)
        try:
            process.open_streams([self._request(process, r, r.inputs) for r in requests], streams,
                                 [r.trace for r in requests])
        except ProcessDied as exc:
            self._in_flight -= len(streams)
            raise ModelUnavailableError(str(exc)) from exc
        return streams

    def read_on_loop(self) -> None:
        """On the event loop: the process's answers are read by the loop from now on, so a stream's
        responses reach their caller without a thread hop and a loop wake-up each."""
        process = self.process
        if process is not None and process.death is None and not process.on_loop:
            process.hand_over(asyncio.get_running_loop())

    def _request(self, process: ModelProcess, request: InferRequest, inputs: dict[str, np.ndarray]) -> tuple:
        """The request as it travels: a p.Request's fields in a plain tuple (protocol.py)."""
        params = request.parameters
        return (request.id, [process.put(n, a) for n, a in inputs.items()], tuple(request.requested_outputs),
                dict(params) if params else {}, request.correlation_id, request.sequence_flags, request.timeout_us)

    def _outputs(self, process: ModelProcess, reply: tuple | str, final: bool = False) -> dict[str, np.ndarray] | FerryError:
        """A p.Reply as it travelled (a plain tuple), or RESCHEDULE."""
        if reply.__class__ is str:  # RESCHEDULE
            return RESCHEDULED
        outputs, error, parameters = reply
        if error is not None:
            return _ERRORS.get(error[0], BackendError)(error[1])
        return Outputs({t[0]: process.view(t) for t in outputs}, parameters, final)

    def is_ready(self) -> bool:
        """Triton's is_ready(), where the model defines it; a dead process is not ready."""
        process = self.process
        if process is None or process.death is not None:
            return False
        return process.is_ready(READY_CHECK_S) if self.checks_ready else True

    def interrupt(self) -> None:
        """The drain grace is over: a call still in flight will not end well, so end its process now."""
        if self._in_flight and self.process is not None:
            log.warning("model '%s': its process (pid %d) was still running a request when the drain grace ran "
                        "out; killed", self.config.name, self.process.pid)
            self.process.kill()

    def held(self) -> tuple:
        return ()  # the model lives in its own process, which unload stops

    def unload(self) -> None:
        if self.process is not None:
            self.process.stop(0 if self._in_flight else FINALIZE_S)
            self.process = None


def _deadline(requests: list[InferRequest]) -> int | None:
    """What BLS calls made for these requests inherit: the earliest deadline, when every request has one."""
    deadlines = [r.deadline_ns for r in requests if r.deadline_ns is not None]
    return min(deadlines) if deadlines and len(deadlines) == len(requests) else None


class _Stream:
    """One decoupled request in a model process: its answers turned into outputs for the runner. Over
    once the final response came (or its caller left) and its execute returned; a dead process ends it
    with UNAVAILABLE."""

    def __init__(self, backend: PythonBackend, process: ModelProcess, request: InferRequest, deliver, executed):
        self.backend, self.process, self.request = backend, process, request
        self._deliver, self._executed = deliver, executed
        self.call = 0  # set by the process before anything is sent
        self._final = self._ran = self._left = self._closed = self._told = False
        self._lock = threading.Lock()  # answers come on the reader thread, the caller leaves on the event loop

    def put(self, answer) -> None:
        """From the model process (its reader thread or the event loop)."""
        with self._lock:
            self._put(answer)

    def _put(self, answer) -> None:
        if isinstance(answer, ProcessDied):
            self._end(ModelUnavailableError(str(answer)))
            self._returned()
            return
        reply, final = answer
        if reply == p.EXECUTED:
            self._returned()
        elif reply == p.RESCHEDULE:  # execute returned with the request rescheduled: it runs again now
            self.request.sequence_flags = 0  # neither its sequence's start any more, nor its end
            self.process.restream(self.call, self.backend._request(self.process, self.request, self.request.inputs))
        elif reply is not None and not self._left:
            self._deliver(self.backend._outputs(self.process, reply, final))
        if final:
            self._end(STREAM_END)

    def cancel(self) -> None:
        """On the event loop: the caller went away (or has read the final response): the model's
        is_cancelled() turns true if it still runs; what it sends from now on is dropped."""
        with self._lock:
            self._tell()
            self._left = True
            self._close()

    def cancel_request(self) -> None:
        """On the event loop: the request is cancelled but its caller stays (Triton's request cancellation):
        the model's is_cancelled() turns true, and whatever it still sends is delivered."""
        with self._lock:
            self._tell()

    def _tell(self) -> None:
        if not self._final and not self._left and not self._told:
            self._told = True
            self.process.cancel(self.call)

    def _end(self, last) -> None:
        if not self._final:
            self._final = True
            if not self._left:
                self._deliver(last)
            self._close()

    def _returned(self) -> None:
        if not self._ran:
            self._ran = True
            self._executed()
            self._close()

    def _close(self) -> None:
        if self._ran and (self._final or self._left) and not self._closed:
            self._closed = True
            self.process.close(self.call)
            self.backend._in_flight -= 1
            self.backend.priority.answered()  # a stream is judged as one call

"""One model instance: a backend and the one thread that runs its batches."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from server.tensors.assembly import Assembler, assembler_for
from server.backends.base import NOT_RUN, Backend
from server.errors import BackendError, FerryError
from server.tensors.padding import PadCount
from server.request import RESCHEDULED, Batch, with_parameters_of
from server.tensors.signature import Signature


@dataclass(slots=True)
class BatchResult:
    outputs: list[dict[str, np.ndarray] | FerryError]  # one per request, in batch order; an error fails that one
    input_ns: int
    infer_ns: int
    output_ns: int
    padding: PadCount = PadCount()  # positions padded / computed along the variable length
    started_ns: int = 0  # monotonic: assembly began (for traces: COMPUTE_START)
    execute_ns: int = 0  # monotonic: the backend's call began (COMPUTE_INPUT_END)


class Worker:
    def __init__(self, backend: Backend, signature: Signature, name: str):
        self.backend = backend
        self.signature = signature
        self.name = name  # the instance's name (its thread's prefix), for traces
        self.assembler: Assembler = assembler_for(signature)  # plain or padded, fixed at load
        self.train_limit = getattr(backend, "train_limit", _one)  # how many single requests one dispatch may carry
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def start(self, batch: Batch, then=None) -> asyncio.Future[BatchResult]:
        """Assemble the batch and hand it to the instance's thread now, from the event loop; `then(future)`
        runs once it is settled.

        The copy is done here because the loop holds the GIL already: on the instance's thread it had
        to win the GIL from the busy loop first, and np.concatenate then let go of it around every
        part (heavy encoder, 64 clients: 2.4 ms of wall time for 0.5 ms of copying per batch; the copy
        now keeps the GIL, see assembly.join_rows). Submitting here
        rather than in the task that awaits the result starts the run before the callbacks already
        queued on the loop. A failure to assemble fails this batch's future, never the caller.

        The thread settles the returned future itself with one call_soon_threadsafe: not
        run_in_executor, whose future is chained to a second, concurrent one through two more
        callbacks on the loop for every batch. An answer the loop reads itself (a model process's) runs
        `then` at once: the instance gets its next batch before the callbacks already queued on the loop
        run, rather than idling behind them.
        """
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if then is not None:
            done.add_done_callback(then)
        t0 = time.monotonic_ns()
        try:
            if getattr(self.backend, "per_request", False):  # the backend answers each request alone
                if self.backend.can_send():
                    self._send(loop, done, batch, then)
                    return done
                inputs, pad_count = None, PadCount()
            else:
                inputs, pad_count = self.assembler.gather(batch)
                if getattr(self.backend, "can_send", None) is not None and self.backend.can_send():
                    self._send_joined(loop, done, batch, inputs, pad_count, time.monotonic_ns() - t0, then)
                    return done
            self._thread.submit(self._run, loop, done, batch, inputs, pad_count, time.monotonic_ns() - t0, t0)
        except Exception as exc:  # noqa: BLE001 - reported through the batch's future
            done.set_exception(exc)
        return done

    def _run(self, loop, done: asyncio.Future, batch: Batch, inputs, pad_count: PadCount, input_ns: int,
             t0: int = 0) -> None:
        """On the instance's thread: run the batch, then hand the result (or the error) to the loop."""
        try:
            result, error = self._execute(batch, inputs, pad_count, input_ns, t0), None
        except Exception as exc:  # noqa: BLE001 - reported through the batch's future
            result, error = None, exc
        _hand_to_loop(loop, done, result, error)

    def _execute(self, batch: Batch, inputs: dict[str, np.ndarray], pad_count: PadCount, input_ns: int,
                 t0: int = 0) -> BatchResult:
        if inputs is None:
            return self._execute_requests(batch, input_ns)
        t1 = time.monotonic_ns()
        try:
            reshape = self.signature.reshape
            outputs = self.backend.execute(reshape.inputs(inputs) if reshape else inputs)
            if reshape:
                outputs = reshape.outputs(outputs, self.signature.model)
        except FerryError:
            raise
        except Exception as exc:  # a model failure fails its own batch, never the server
            raise BackendError(f"model '{self.signature.model}' failed: {exc}") from exc
        t2 = time.monotonic_ns()
        self._check(outputs)
        split = self.assembler.split(batch, outputs)
        return BatchResult(split, input_ns, t2 - t1, time.monotonic_ns() - t2, pad_count, t0, t1)

    def _send(self, loop, done: asyncio.Future, batch: Batch, then=None) -> None:
        """A backend that runs elsewhere (a model process) and is ready takes the batch from the loop, and
        its answer settles the future from wherever it arrives: no hop through the instance's thread,
        which only a backend that must first be (re)started needs."""
        reshape, t1 = self.signature.reshape, time.monotonic_ns()

        def answered(answers: list) -> None:
            if NOT_RUN in answers:  # a train's process died: the rest of it runs on the next, from the thread
                self._thread.submit(self._run_rest, loop, done, batch, answers, t1, then)
                return
            try:
                result, error = self._answers(batch, answers, t1, time.monotonic_ns()), None
            except Exception as exc:  # noqa: BLE001 - reported through the batch's future
                result, error = None, exc
            _hand_to_loop(loop, done, result, error, then)

        send = self.backend.send_train if batch.train else self.backend.send_requests
        send(batch.requests, [reshape.inputs(r.inputs) if reshape else r.inputs for r in batch.requests], answered)

    def _run_rest(self, loop, done: asyncio.Future, batch: Batch, answers: list, t1: int, then) -> None:
        """On the instance's thread: a train's requests that never began, each run alone (the backend starts
        a new process first), so a crash fails only the request that was running."""
        reshape = self.signature.reshape
        try:
            for i, request in enumerate(batch.requests):
                if answers[i] is NOT_RUN:
                    answers[i] = self.backend.execute_requests(
                        [request], [reshape.inputs(request.inputs) if reshape else request.inputs])[0]
            result, error = self._answers(batch, answers, t1, time.monotonic_ns()), None
        except Exception as exc:  # noqa: BLE001 - reported through the batch's future
            result, error = None, exc
        _hand_to_loop(loop, done, result, error, then)

    def _send_joined(self, loop, done: asyncio.Future, batch: Batch, inputs: dict[str, np.ndarray], pad_count: PadCount,
                     input_ns: int, then=None) -> None:
        """`_send` for a backend that takes the batch joined (Ferry's `class Model` in a model process)."""
        reshape, t1 = self.signature.reshape, time.monotonic_ns()

        def answered(outputs) -> None:
            try:
                if isinstance(outputs, Exception):
                    raise outputs
                outputs = reshape.outputs(outputs, self.signature.model) if reshape else outputs
                t2 = time.monotonic_ns()
                self._check(outputs)
                split = self.assembler.split(batch, outputs)
                result = BatchResult(split, input_ns, t2 - t1, time.monotonic_ns() - t2, pad_count, t1 - input_ns, t1)
                error = None
            except FerryError as exc:
                result, error = None, exc
            except Exception as exc:  # noqa: BLE001 - a model failure fails its own batch, never the server
                result, error = None, BackendError(f"model '{self.signature.model}' failed: {exc}")
            _hand_to_loop(loop, done, result, error, then)

        self.backend.send_joined(reshape.inputs(inputs) if reshape else inputs, answered)

    def _execute_requests(self, batch: Batch, input_ns: int) -> BatchResult:
        """A backend that takes the batch's requests as they came (Triton's Python models) answers each
        alone: an error or a malformed answer fails its own request, never the others."""
        reshape = self.signature.reshape
        t1 = time.monotonic_ns()
        inputs = [reshape.inputs(r.inputs) if reshape else r.inputs for r in batch.requests]
        if batch.train:  # each request its own execute, as the model expects
            answers = [a for r, i in zip(batch.requests, inputs) for a in self.backend.execute_requests([r], [i])]
        else:
            answers = self.backend.execute_requests(batch.requests, inputs)
        result = self._answers(batch, answers, t1, time.monotonic_ns())
        result.input_ns = input_ns
        return result

    def _answers(self, batch: Batch, answers: list, t1: int, t2: int) -> BatchResult:
        reshape = self.signature.reshape
        if len(answers) != len(batch.requests):
            raise BackendError(f"model '{self.signature.model}' answered {len(answers)} of {len(batch.requests)} requests")
        checked = []
        for request, answer in zip(batch.requests, answers):
            if not isinstance(answer, FerryError) and answer is not RESCHEDULED:  # rescheduled: no response yet
                try:
                    if reshape:
                        answer = with_parameters_of(reshape.outputs(answer, self.signature.model), answer)
                    self._check(answer, request.requested_outputs, strict_types=False)
                except FerryError as exc:
                    answer = exc
            checked.append(answer)
        return BatchResult(checked, 0, t2 - t1, time.monotonic_ns() - t2, PadCount(), t1, t1)  # no assembly: sent as they came

    def _check(self, outputs: dict[str, np.ndarray], names: tuple[str, ...] = (), strict_types: bool = True) -> None:
        """Every output asked for is there; with `strict_types`, in the declared datatype. Triton's Python
        models are not held to it (Triton answers with the dtype the model made, and its examples rely on
        that: a declared INT32 sum made as numpy's default int64)."""
        for name in names or self.signature.outputs:
            spec, value = self.signature.outputs[name], outputs.get(name)
            if value is None:
                raise BackendError(f"model '{self.signature.model}' did not produce output '{name}'")
            if strict_types and spec.datatype.api != "BYTES" and value.dtype != spec.datatype.numpy:
                raise BackendError(
                    f"model '{self.signature.model}' produced output '{name}' as {value.dtype}; "
                    f"the config declares {spec.datatype.config}"
                )

    def close(self) -> None:
        """After the drain grace: a backend that can end a run in flight (a model process) does, so the
        thread's shutdown never waits on a model that does not return."""
        interrupt = getattr(self.backend, "interrupt", None)
        if interrupt is not None:
            interrupt()
        self._thread.shutdown(wait=True)
        self.backend.unload()


def _one() -> int:
    return 1


def _hand_to_loop(loop, done: asyncio.Future, result, error: Exception | None, then=None) -> None:
    """From any thread: settle `done` on its loop with one call_soon_threadsafe. On the loop itself (a
    model process's answer, read by the loop): at once, without waking the loop through its self-pipe,
    and `then` (a callback of `done`) runs now rather than behind the callbacks queued on the loop."""
    if asyncio._get_running_loop() is loop:
        _settle(done, result, error)
        if then is not None and done.remove_done_callback(then):
            then(done)
        return
    try:
        loop.call_soon_threadsafe(_settle, done, result, error)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


def _settle(done: asyncio.Future, result: BatchResult | None, error: Exception | None) -> None:
    if done.done():  # cancelled while it ran
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)

"""One model instance: a backend and the one thread that runs its batches."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from server.assembly import Assembler, assembler_for
from server.backends.base import Backend
from server.errors import BackendError, FerryError
from server.padding import PadCount
from server.request import Batch
from server.signature import Signature


@dataclass(slots=True)
class BatchResult:
    outputs: list[dict[str, np.ndarray]]  # one per request, in batch order
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
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def start(self, batch: Batch) -> asyncio.Future[BatchResult]:
        """Assemble the batch and hand it to the instance's thread now, from the event loop.

        The copy is done here because the loop holds the GIL already: on the instance's thread it had
        to win the GIL from the busy loop first, and np.concatenate then let go of it around every
        part (heavy encoder, 64 clients: 2.4 ms of wall time for 0.5 ms of copying per batch; the copy
        now keeps the GIL, see assembly.join_rows). Submitting here
        rather than in the task that awaits the result starts the run before the callbacks already
        queued on the loop. A failure to assemble fails this batch's future, never the caller.

        The thread settles the returned future itself with one call_soon_threadsafe: not
        run_in_executor, whose future is chained to a second, concurrent one through two more
        callbacks on the loop for every batch.
        """
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        t0 = time.monotonic_ns()
        try:
            inputs, pad_count = self.assembler.gather(batch)
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
        try:
            loop.call_soon_threadsafe(_settle, done, result, error)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _execute(self, batch: Batch, inputs: dict[str, np.ndarray], pad_count: PadCount, input_ns: int,
                 t0: int = 0) -> BatchResult:
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

    def _check(self, outputs: dict[str, np.ndarray]) -> None:
        for name, spec in self.signature.outputs.items():
            value = outputs.get(name)
            if value is None:
                raise BackendError(f"model '{self.signature.model}' did not produce output '{name}'")
            if spec.datatype.api != "BYTES" and value.dtype != spec.datatype.numpy:
                raise BackendError(
                    f"model '{self.signature.model}' produced output '{name}' as {value.dtype}; "
                    f"the config declares {spec.datatype.config}"
                )

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.backend.unload()


def _settle(done: asyncio.Future, result: BatchResult | None, error: Exception | None) -> None:
    if done.done():  # cancelled while it ran
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)

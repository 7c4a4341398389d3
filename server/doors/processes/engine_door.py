"""The engine's side of the front-end link: run the ModelInfer calls front ends decoded, answer through the arena.

What happens here is what rpc/servicer.py's ModelInfer does after decoding, in the same order and with
the same functions (frontdoor.serving, frontdoor.infer_request, the runner, classification), so codes,
messages, statistics and metrics are the ones one process gives. A cancelled front-end call cancels its
task here, which leaves the runner's queue as a cancelled gRPC handler does. Inputs are numpy views
into the arena: each request-half block is handed back (FREE) only when its last view is gone, which
may be after a cancelled request's batch has finished with it. Tracing is the engine's too: it samples
calls and writes their traces, the front end's timestamps coming over this link (tracing/hop.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import numpy as np

from server.doors.drain import SHUTTING_DOWN, Drain
from server.errors import FerryError, ModelUnavailableError
from server.doors.shared import class_counts, classified, infer_request, serving
from server.doors.processes import messages as m
from server.ipc.arena import Allocator, Arena
from server.ipc import tensors as ipc_tensors
from server.ipc.frames import FrameLink
from server.names import capped
from server.repository.registry import Registry
from server.request import parameters_of
from server.doors.grpc.errors import status_of
from server.observability.tracing import doors as trace_doors
from server.observability.tracing import hop
from server.observability.tracing.control import TraceControl
from server.runners.base import INFER

log = logging.getLogger(__name__)


class EngineDoor:
    """Listens on a private unix socket; one `_Link` per connected front-end process."""

    def __init__(self, registry: Registry, drain: Drain, folder: Path, arena_bytes: int,
                 tracing: TraceControl | None = None):
        self.registry, self.drain = registry, drain
        self.tracing = tracing or TraceControl()  # the server's one: the front ends' calls are sampled here
        self.tracing.watch(self._tracing_changed)
        self.folder, self.arena_bytes = folder, arena_bytes
        self.path = folder / "engine-door.sock"
        self.arenas: dict[int, Arena | None] = {}  # front end index -> the arena its current process maps
        self.hello: dict[int, asyncio.Future] = {}  # front end index -> resolved with its pid on connection
        self.links: set[_Link] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.get_running_loop().create_unix_server(lambda: _Link(self).frames, str(self.path))

    def new_arena(self, index: int, generation: int) -> Path | None:
        """A fresh arena for front end `index`'s next process; None (tensors go inline) if /dev/shm is full."""
        self.hello[index] = asyncio.get_running_loop().create_future()
        previous = self.arenas.get(index)
        if previous is not None:  # unlinked at its hello already, unless that process died before saying it
            previous.unlink()
        self.arenas[index] = None
        if self.arena_bytes <= 0:
            return None
        path = Path("/dev/shm") / f"ferry-{self.path.parent.name}-{index}-{generation}"
        try:
            self.arenas[index] = Arena(path, self.arena_bytes, create=True)
        except OSError as exc:
            log.warning("front end %d: no shared memory arena (%s); its tensors travel inline", index, exc)
            return None
        return path

    def _tracing_changed(self, active: bool) -> None:
        for link in self.links:
            link.frames.send((m.TRACING, active))

    def stop_frontends(self, grace_s: float) -> None:
        """Drain is over: every front end waits for its callers to leave (within `grace_s`), then exits."""
        for link in self.links:
            link.frames.send((m.STOP, grace_s))

    async def stop(self) -> None:
        for arena in self.arenas.values():
            if arena is not None:
                arena.unlink()
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.close()


class _Link:
    """One front-end process: its calls in flight and the answer half of its arena."""

    def __init__(self, door: EngineDoor):
        self.door = door
        self.frames = FrameLink(self._frame, self._lost)
        self.arena: Arena | None = None
        self.answers: Allocator | None = None
        self.tasks: dict[int, asyncio.Task] = {}
        self.sending: dict[int, object] = {}  # rid -> the trace of a traced answer, until the front end's SENT
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._freed: list[int] = []
        door.links.add(self)

    def _frame(self, frame: tuple) -> None:
        kind = frame[0]
        if kind == m.INFER:
            call = m.InferCall._make(frame[1])
            self.tasks[call.rid] = self.loop.create_task(self._infer(call))
        elif kind == m.CANCEL:
            task = self.tasks.get(frame[1])
            if task is not None:
                task.cancel()
        elif kind == m.FREE:
            for offset in frame[1]:
                self.answers.free(offset)
        elif kind == m.SENT:
            trace = self.sending.pop(frame[1], None)
            if trace is not None:
                hop.sent(trace, frame[2], frame[3])
        elif kind == m.HELLO:
            self._hello(frame[1], frame[2])

    def _hello(self, index: int, pid: int) -> None:
        self.arena = self.door.arenas.get(index)
        if self.arena is not None:
            self.arena.unlink()  # both processes map it now: nothing is left in /dev/shm whatever happens
            self.answers = Allocator(self.arena.half, self.arena.size - self.arena.half)
        waiter = self.door.hello.get(index)
        if waiter is not None and not waiter.done():
            waiter.set_result(pid)
        if self.door.tracing.active:
            self.frames.send((m.TRACING, True))

    def _lost(self, exc) -> None:
        self.door.links.discard(self)
        if self.answers is not None and self.answers.used and not self.tasks:
            log.warning("a front end left with %d bytes of the arena's answer half still held", self.answers.used)
        for task in self.tasks.values():  # the front end is gone: nobody waits for these answers
            task.cancel()
        for trace in self.sending.values():
            hop.ended(trace, "the front end process went away before the answer was sent")
        self.sending.clear()

    def close(self) -> None:
        self.frames.close()

    async def _infer(self, call: m.InferCall) -> None:
        trace = None
        if self.door.tracing.active:
            trace = hop.begin(self.door.tracing, call.model_name, call.id, call.arrival_ns, call.carrier)
        try:
            version, outputs, params = await self._run(call, trace)
            answers = [self._answer(n, a) for n, a in outputs]
            if trace is None:
                self.frames.send((m.DONE, call.rid, version, answers, params))
            else:  # the front end marks the send and tells (SENT)
                self.sending[call.rid] = trace
                self.frames.send((m.TRACED, call.rid, version, answers, params))
                trace = None
        except asyncio.CancelledError:
            return  # the caller cancelled or went away: no answer is read
        except _Refused as exc:
            self._error(call.rid, exc.status, exc.message, trace)
        except FerryError as exc:
            self._error(call.rid, status_of(exc).name, capped(exc.message), trace)
        except Exception as exc:  # the server keeps serving whatever a request hits
            log.exception("unexpected error in ModelInfer")
            self._error(call.rid, "INTERNAL", f"internal error: {type(exc).__name__}: {exc}", trace)
        finally:
            self.tasks.pop(call.rid, None)
            if trace is not None:  # cancelled (or failed, with its message already set)
                hop.ended(trace, "cancelled")

    def _error(self, rid: int, status: str, message: str, trace) -> None:
        self.frames.send((m.ERROR, rid, status, message))
        if trace is not None:
            trace.attributes["error"] = f"{status}: {message}"

    async def _run(self, call: m.InferCall, trace=None) -> tuple[int, list[tuple[str, np.ndarray]], dict]:
        """rpc/servicer.py's `_infer` from `serving` on, for a call the front end decoded."""
        if self.door.drain.closed:  # the front end's own gate refuses first; this covers a call already on its way
            self.door.drain.refuse()
            raise ModelUnavailableError(SHUTTING_DOWN)
        try:
            mv = serving(self.door.registry, call.model_name, call.model_version, INFER)
            if call.input_error is not None:
                raise _Refused(*call.input_error)
        except BaseException:
            self._free_blocks(call.inputs)
            raise
        inputs = self._inputs(call.inputs)
        infer = infer_request(mv, inputs, call.requested, call.parameters, call.id, call.arrival_ns, call.remaining_s,
                              call.nbytes)
        del inputs
        if call.output_error is not None:
            raise _Refused(*call.output_error)
        counts = class_counts(call.output_parameters, mv.signature)
        if trace is not None:
            trace_doors.attach(trace, infer, mv.version)
        outputs = await mv.runner.infer(infer)
        if trace is not None:
            trace_doors.answered(trace, outputs)
        names = infer.requested_outputs or tuple(mv.signature.outputs)
        outputs = classified(outputs, counts, mv.signature)
        return mv.version, [(name, outputs[name]) for name in names], parameters_of(outputs)

    def _inputs(self, sent: list[m.Tensor]) -> dict[str, np.ndarray]:
        inputs = {}
        for i, tensor in enumerate(sent):
            try:
                inputs[tensor.name] = self._input(tensor)
            except BaseException:
                self._free_blocks(sent[i:])
                raise
        return inputs

    def _input(self, tensor: m.Tensor) -> np.ndarray:
        return ipc_tensors.view(tensor, self.arena, self._free)

    def _free_blocks(self, sent: list[m.Tensor]) -> None:
        """Blocks no array was made from (a call refused before its inputs were read)."""
        for tensor in sent:
            if tensor.offset is not None:
                self._free(tensor.offset)

    def _free(self, offset: int) -> None:
        """Hand a request-half block back; the last view may die on an instance thread."""
        first = not self._freed
        self._freed.append(offset)
        if first:
            if threading.get_ident() == self._loop_thread:
                self.loop.call_soon(self._send_freed)
            else:
                self.loop.call_soon_threadsafe(self._send_freed)

    def _send_freed(self) -> None:
        freed, self._freed = self._freed, []
        if freed:
            self.frames.send((m.FREE, freed))

    def _answer(self, name: str, array: np.ndarray) -> m.Tensor:
        """One output, written once into the answer half (inline when it does not fit)."""
        return ipc_tensors.put(name, array, self.arena, self.answers)


class _Refused(FerryError):
    """An error the front end found while decoding, answered here in the order one process answers it."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


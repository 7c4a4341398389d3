"""A model process: `python -m server.backends.python.child FD ARENA_PATH ARENA_BYTES`.

It imports the model.py it is told to, exposes `triton_python_backend_utils` to it, and serves its
instance in the server over the socket inherited as FD. The main thread runs model code, one work
item at a time (initialize, execute, finalize), on an event loop of its own for `async def` models, and
reads the socket itself while idle; while model code runs a helper thread reads, so BLS answers,
cancellations and freed blocks are seen meanwhile. Model code that raises anything (SystemExit and KeyboardInterrupt included)
fails the requests of that execute with its message and the process keeps serving; if the server
goes away (EOF), the process exits.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import json
import os
import queue
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path

from server.backends.python import answers, faces, forks
from server.backends.python import pb_utils as pb
from server.backends.python import protocol as p
from server.ipc import tensors as ipc_tensors
from server.ipc.arena import Allocator, Arena
from server.ipc.frames import FrameSocket

_END = object()
_NUDGE = ("nudge",)  # from the helper: the main thread may read the socket itself again
_WORK = {p.INIT, p.AUTO, p.EXEC, p.EXECS, p.STREAM, p.FINALIZE}
# Triton's words (its spelling too: model code and its QA suite look for them)
BLS_OUTSIDE_EXECUTE = "BLS is only supported during the 'execute' function."
RETURNED_FOR_RESCHEDULED = "Expected a None object in the execute function return list for reschduled request"


class Host:
    """What model code reaches through pb_utils: the link to the server, the arena, pending calls."""

    def __init__(self, link: FrameSocket, arena: Arena | None):
        self.link, self.arena = link, arena
        self._blocks = Allocator(arena.half, arena.size - arena.half) if arena is not None else None
        self._blocks_lock = threading.Lock()
        self._freed: collections.deque[int] = collections.deque()  # appended by finalizers, on any thread
        self._work: queue.Queue = queue.Queue()  # work the helper read while the main thread was busy
        self._reading = threading.Lock()  # held by whichever thread is in recv
        self._busy = threading.Event()  # the main thread has run model code since the helper last looked
        self._wanted = threading.Event()  # model code waits for an answer (BLS): the helper reads at once
        self._running = False  # the main thread is in model code now
        self._started = 0  # work items begun: tells the helper whether the one it timed is still running
        self._pending: dict[int, tuple[Future, queue.Queue | None]] = {}  # BLS and control calls
        self._refs = itertools.count(1)
        self._cancelled: set[int] = set()
        self._streaming: set[int] = set()  # decoupled calls whose final response is not sent yet
        self._batches: dict[int, answers.Batch] = {}  # EXEC calls not yet answered in full (response senders)
        self.loop = asyncio.new_event_loop()
        self.face: faces.Face | None = None
        self._current = 0  # the EXEC call running (or last run)
        self._began = 0  # perf_counter_ns when the EXEC call running began (0: none runs): its DONE says how long it took
        self._iterative = False  # the config's sequence_batching.iterative_sequence: requests may be rescheduled
        self._instance = ""  # Triton's name of this instance (`<model>_0_0`), in the messages of failed executes
        self.forks: forks.Forks | None = None  # set by main: relays for children model code forks
        self._serving = False  # between a successful initialize and finalize: BLS is allowed (as Triton)

    # ---- reading: the main thread while it is idle, the helper thread while model code runs
    def _take(self) -> tuple:
        """The next work item for the main thread. An idle main thread reads the socket itself (one
        thread wake-up less per request); while it runs model code the helper reads, so BLS answers,
        cancellations and freed blocks are seen, and hands work over through the queue."""
        while True:
            try:
                return self._work.get_nowait()
            except queue.Empty:
                pass
            if self._reading.acquire(blocking=False):
                try:
                    frame = self.link.recv()
                finally:
                    self._reading.release()
                if frame is None:
                    os._exit(0)  # the server is gone: nobody will read what this process makes
                if frame[0] in _WORK:
                    return frame
                self._handle(frame)
                continue
            frame = self._work.get()  # the helper is reading: it hands work over (or nudges)
            if frame is not _NUDGE:
                return frame

    def help_read(self) -> None:
        """The helper thread: reads while one work item has run for 2 ms, or at once while model code
        waits for an answer (BLS, model control). Short executes back to back, the common case under
        load, leave the reading to the main thread: then the helper wakes every 2 ms at most, not once a
        request, and no frame hops between threads."""
        while True:
            self._busy.wait()
            started = self._started
            self._wanted.wait(0.002)
            if not self._running:
                self._busy.clear()
                if self._running:  # a work item began between the check and the clear
                    self._busy.set()
                continue
            if self._started != started and not self._wanted.is_set():
                continue  # a newer work item: it gets its own 2 ms
            with self._reading:
                frame = self.link.recv()
            if frame is None:
                os._exit(0)
            if frame[0] in _WORK:
                self._work.put(frame)
            else:
                self._handle(frame)
                if not self._running:
                    self._work.put(_NUDGE)  # the main thread may be waiting on the queue: let it read again

    def _handle(self, frame: tuple) -> None:
        kind = frame[0]
        if kind == p.CALLED:
            self._called(*frame[1:])
        elif kind == p.CANCEL:
            self._cancelled.add(frame[1])
        elif kind == p.FREE:
            self._free_ours(frame[1])
        elif kind == p.HANDOVER:
            self.link.send((p.HANDOVER,))
        elif kind == p.CHECK:  # on a thread of its own: a slow is_ready() holds up neither reads nor executes
            threading.Thread(target=self._check, args=(frame[1],), name="ferry-is-ready", daemon=True).start()

    def _check(self, ref: int) -> None:
        try:
            ready = self.face.is_ready()
            if not isinstance(ready, bool):  # as Triton: only True is ready
                raise TypeError(f"is_ready must return a bool, got {type(ready).__name__}")
        except BaseException as exc:  # noqa: BLE001 - a readiness check that fails says "not ready"
            print(f"is_ready failed: {_message(exc)}", file=sys.stderr)
            ready = False
        self.link.send((p.CHECKED, ref, ready))

    def _called(self, ref: int, reply: tuple | None, final: bool) -> None:
        if self.forks is not None and self.forks.called(ref, reply, final):
            return  # a forked child's call: its relay passes the answer on
        future, items = self._pending.get(ref, (None, None))
        if future is None:
            return
        if items is None:  # one answer
            del self._pending[ref]
            future.set_result(self._response(reply))
            return
        if reply is not None:
            items.put(self._response(reply))
        elif final:
            items.put(pb.InferenceResponse())  # the final flag sent alone: Triton's last, empty response
        if final:
            del self._pending[ref]
            items.put(_END)
        if not future.done():  # as in Triton, exec(decoupled=True) answers with the first response
            future.set_result(_Responses(items, functools.partial(self.link.send, (p.UNCALL, ref))))

    # ---- the main thread
    def serve(self) -> None:
        while True:
            frame = self._take()
            self._started += 1
            self._running = True
            if not self._busy.is_set():  # set already while work comes back to back: no lock, no wake-up
                self._busy.set()
            kind = frame[0]
            if kind == p.INIT:
                self._init(frame[1])
            elif kind == p.AUTO:
                self._auto(*frame[1:])
            elif kind == p.EXEC:
                self._exec(*frame[1:])
            elif kind == p.EXECS:
                self._free_ours(frame[2])
                for call, requests in frame[1]:
                    self._exec(call, requests, ())
            elif kind == p.STREAM:
                self._stream(*frame[1:])
            elif kind == p.FINALIZE:
                self._finalize()
                return
            del frame
            self._running = False
            if self._wanted.is_set():
                self._wanted.clear()
            self.flush_freed()

    def _init(self, args: dict) -> None:
        try:
            pb.set_model_dir(args.get("ferry_version_dir", ""))
            module = faces.import_model(Path(args["ferry_model_path"]))
            self.face = faces.face_of(module, Path(args["ferry_model_path"]), self.loop)
            batching = json.loads(args.get("model_config") or "{}").get("sequence_batching") or {}
            self._iterative = bool(batching.get("iterative_sequence"))
            self._instance = args.get("model_instance_name", "")
            self.face.initialize(args)
        except BaseException as exc:  # noqa: BLE001 - a model that cannot start says why, and the load fails
            self.link.send((p.FAILED, _message(exc)))
            return
        self._serving = True
        self.link.send((p.READY, self.face.kind, self.face.checks_ready))

    def _auto(self, model_path: str, config_json: str) -> None:
        try:
            module = faces.import_model(Path(model_path))
            completed = module.TritonPythonModel.auto_complete_config(pb.ModelConfig(config_json))
            if not isinstance(completed, pb.ModelConfig):
                raise pb.TritonModelException("auto_complete_config must return the pb_utils.ModelConfig it was given")
        except BaseException as exc:  # noqa: BLE001
            self.link.send((p.FAILED, _message(exc)))
            return
        self.link.send((p.AUTO, json.dumps(completed.as_dict())))

    def _exec(self, call: int, requests: list[tuple], freed: list[int]) -> None:
        """A batch of a model that is not decoupled: each request is answered once, by the response
        execute returns for it or through its response sender (before or after execute returns, as
        Triton allows); the batch is done (DONE) once every request has its answer."""
        self._began = time.perf_counter_ns()
        self._free_ours(freed)
        self._current = call
        built = [self._request(r, call, i) for i, r in enumerate(requests)]
        batch = self._batches[call] = answers.Batch(len(built), self._reply)
        try:
            returned = self.face.run(built)
            batch.returned([self._released(request, r) or r for request, r in zip(built, returned)])
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too: the process keeps serving
            self._execute_failed(exc)
            batch.failed(p.Reply([], (p.INTERNAL, self._failure(exc))))
        del built
        self._answered(call)
        self._began = 0

    def _answered(self, call: int) -> None:
        """The batch's DONE, once every request has its answer (from whichever thread gave the last)."""
        batch = self._batches.get(call)
        if batch is None or not batch.complete():
            return
        if self._batches.pop(call, None) is None:
            return  # another thread sent it
        self._cancelled.discard(call)
        replies = [r if r.__class__ is str else tuple(r) for r in batch.replies]  # as they travel (protocol.py)
        took = time.perf_counter_ns() - self._began if self._began and call == self._current else 0  # 0: by a sender, later
        self.link.send((p.DONE, call, replies, self._take_freed(), took))  # blocks freed so far ride along

    def _failure(self, exc: BaseException) -> str:
        """What the callers of an execute that raised read: Triton's words around the exception's."""
        if isinstance(exc, faces.ReturnedResponses):
            return (f"Python model '{self._instance}' is using the decoupled mode and the execute function must "
                    "return None. Responses go through each request's response sender.")
        return f"Failed to process the request(s) for model instance '{self._instance}', message: {_message(exc)}"

    def _execute_failed(self, exc: BaseException) -> None:
        """As Triton's stub: the exception's traceback in the server's log (the caller reads its message)."""
        self.log(2, "Failed to execute the request(s): " + "".join(
            traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())

    def _stream(self, calls: list[int], requests: list[tuple], freed: list[int]) -> None:
        """Decoupled requests, one execute (a batch of them where the model batches; one request when it
        may reschedule, which is decided per execute)."""
        self._free_ours(freed)
        self._streaming.update(calls)
        self._current = calls[0]  # what its BLS calls inherit
        built = [self._request(r, call) for call, r in zip(calls, requests)]
        try:
            # An async execute awaits on the instance's own loop, so the next batch starts meanwhile (as in
            # Triton); not where requests may be rescheduled: that is decided when execute returns.
            running = self.face.run_decoupled(built, [pb.InferenceResponseSender(self, call) for call in calls],
                                              concurrent=not self._iterative)
        except BaseException as exc:  # noqa: BLE001
            running = None
            self._execute_failed(exc)
            for call in calls:
                self._failed(call, exc)
        if running is not None:
            running.add_done_callback(functools.partial(self._async_done, calls))
        for call, request in zip(calls, built):
            released = None
            if running is None and call in self._streaming and request._rescheduled():
                released = self._released(request)  # rescheduled, with no final response yet
            if released == p.RESCHEDULE:  # it runs again
                self.link.send((p.RESPONSE, call, p.RESCHEDULE, False))
                continue
            if released is not None:
                self.respond(call, self._response(released), True)  # refused: the model may not reschedule
            self.link.send((p.RESPONSE, call, p.EXECUTED, False))  # the instance is free; senders may go on

    def _async_done(self, calls: list[int], done: Future) -> None:
        """On the instance's async loop: a decoupled async execute is over."""
        if not done.cancelled() and done.exception() is not None:
            self._execute_failed(done.exception())
            for call in calls:
                self._failed(call, done.exception())

    def _failed(self, call: int, exc: BaseException) -> None:
        """A decoupled execute raised: its request ends with the message, unless its final response is out."""
        if call in self._streaming:
            self.respond(call, pb.InferenceResponse(error=pb.TritonError(self._failure(exc))), True)

    def _released(self, request: pb.InferenceRequest, returned=None) -> str | p.Reply | None:
        """What a request the model rescheduled gets in place of a response: run again, where the config
        allows it and execute returned None for it (a response returned for it is Triton's error); None if
        not rescheduled."""
        if not request._rescheduled():
            return None
        if self._iterative and returned is not None:
            return p.Reply([], (p.INTERNAL, RETURNED_FOR_RESCHEDULED))
        if self._iterative:
            return p.RESCHEDULE
        return p.Reply([], (p.UNSUPPORTED, "Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, but the "
                                           "model's config does not let requests be rescheduled: add "
                                           "sequence_batching { iterative_sequence: true }"))

    def _finalize(self) -> None:
        self._serving = False
        try:
            if self.face is not None:
                self.face.finalize()
        except BaseException as exc:  # noqa: BLE001 - the process ends either way
            print(f"finalize failed: {_message(exc)}", file=sys.stderr)

    # ---- what pb_utils calls
    def respond(self, call: int, response: pb.InferenceResponse | None, final: bool) -> None:
        if call not in self._streaming:
            raise pb.TritonModelException(pb.SENDER_CLOSED)
        if final:
            self._streaming.discard(call)
            self._cancelled.discard(call)
        self.link.send((p.RESPONSE, call, tuple(self._reply(response)) if response is not None else None, final))

    def sender(self, call: int, index: int = 0):
        batch = self._batches.get(call)
        if batch is None:
            return pb.InferenceResponseSender(self, call)
        return answers.Sender(batch, index, functools.partial(self._answered, call), functools.partial(self.cancelled, call))

    def cancelled(self, call: int) -> bool:
        return call in self._cancelled

    def call(self, request: pb.InferenceRequest, decoupled: bool) -> Future:
        """A BLS request: sent to the server, answered by CALLED frames (the reader thread resolves it).
        Refused in initialize and finalize, as Triton's stub refuses it (the called models' state is not
        the caller's to rely on then)."""
        if not self._serving:
            raise pb.TritonModelException(BLS_OUTSIDE_EXECUTE)
        ref, future = next(self._refs), Future()
        items = queue.Queue() if decoupled else None
        self._pending[ref] = (future, items)
        version = "" if request.model_version in (-1, "", None) else str(request.model_version)
        sent = p.Call(request.model_name, version, [self._put(t.name(), t.array) for t in request.inputs()],
                      tuple(request.requested_output_names()), json.loads(request.parameters()), request.request_id(),
                      int(request.timeout()), decoupled, _trace_ref(request.trace()), request.correlation_id(),
                      request.flags())
        self._wanted.set()
        self.link.send((p.CALL, ref, tuple(sent), self._current))  # the execute it is made for: its deadline
        return future

    def control(self, op: str, name: str, version: str, config: str, files: dict):
        ref, future = next(self._refs), Future()
        self._pending[ref] = (future, None)
        self._wanted.set()
        self.link.send((p.CONTROL, ref, op, name, version, config, files))
        response = future.result()
        if response.has_error():
            raise pb.TritonModelException(response.error().message())
        return json.loads(response.parameters()).get("value")

    def metric(self, *update) -> None:
        """Acknowledged, as Triton's stub waits for its server: a /metrics read the model makes right after an
        update (its own tests do) sees the update. Bounded, so a server that stopped answering cannot hold
        finalize."""
        ref, future = next(self._refs), Future()
        self._pending[ref] = (future, None)
        self._wanted.set()
        self.link.send((p.METRIC, ref, *update))
        try:
            future.result(timeout=30)
        except TimeoutError:
            self._pending.pop(ref, None)

    def log(self, level: int, message: str) -> None:
        self.link.send((p.LOG, level, message))

    # ---- forked children (forks.py)
    def next_ref(self) -> int:
        return next(self._refs)

    def ask(self, frame: tuple) -> None:
        """A forked child's call, sent under our ref; model code waits for it, so the reader reads at once."""
        self._wanted.set()
        self.link.send(frame)

    def view(self, tensor: tuple):
        return self._view(tensor)

    def forked(self, link: FrameSocket) -> None:
        """In a child forked by model code, before anything else runs there: its own link (to its parent's
        relay), locks and tables of its own (the parent's threads may have held its locks at the fork), no
        arena (tensors travel inline), and a thread that reads the answers to its calls."""
        self.link, self.arena, self._blocks = link, None, None
        self._blocks_lock, self._reading = threading.Lock(), threading.Lock()
        self._pending, self._batches, self._streaming, self._cancelled = {}, {}, set(), set()
        self._work, self._freed = queue.Queue(), collections.deque()
        self._busy, self._wanted = threading.Event(), threading.Event()
        threading.Thread(target=self._read_forked, name="ferry-forked-reader", daemon=True).start()

    def _read_forked(self) -> None:
        while (frame := self.link.recv()) is not None:
            if frame[0] == p.CALLED:
                self._called(*frame[1:])

    # ---- tensors
    def _put(self, name: str, array) -> tuple:
        """A Tensor record as it travels (a plain tuple)."""
        with self._blocks_lock:
            return tuple(ipc_tensors.put(name, array, self.arena, self._blocks))

    def _view(self, tensor: tuple):
        return ipc_tensors.view(tensor, self.arena, self._free)

    def _free(self, offset: int) -> None:
        self._freed.append(offset)  # atomic: safe inside a garbage collection that interrupted a send

    def _take_freed(self) -> list[int]:
        freed = []
        while self._freed:
            freed.append(self._freed.popleft())
        return freed

    def flush_freed(self) -> None:
        """After a work item: a FREE frame only when many blocks wait (the next DONE carries a few)."""
        if len(self._freed) >= 64:
            self.link.send((p.FREE, self._take_freed()))

    def _free_ours(self, offsets: list[int]) -> None:
        if offsets:
            with self._blocks_lock:
                for offset in offsets:
                    self._blocks.free(offset)

    def _request(self, request: tuple, call: int, index: int = 0) -> pb.InferenceRequest:
        request = p.record(p.Request, request)
        inputs = [pb.Tensor(t[0], self._view(t)) for t in request.inputs]
        return pb.InferenceRequest("", inputs, list(request.requested), request.id, request.correlation_id,
                                   request.flags, request.timeout_us, parameters=request.parameters, _call=call,
                                   _index=index)

    def _reply(self, response) -> p.Reply:
        if isinstance(response, pb.TritonError):
            return p.Reply([], (response.code(), response.message()))
        if not isinstance(response, pb.InferenceResponse):
            return p.Reply([], (p.INTERNAL, f"execute returned {type(response).__name__} where an "
                                            "InferenceResponse was expected"))
        if response.has_error():
            error = response.error()
            return p.Reply([], (error.code(), error.message()))
        outputs = [self._put(t.name(), t.array) for t in response.output_tensors()]
        return p.Reply(outputs, None, json.loads(response.parameters()) or None)

    def _response(self, reply: tuple) -> pb.InferenceResponse:
        """A p.Reply as it travelled (a plain tuple)."""
        outputs, error, parameters = reply
        if error is not None:
            return pb.InferenceResponse(error=pb.TritonError(error[1], error[0]))
        return pb.InferenceResponse([pb.Tensor(t[0], self._view(t)) for t in outputs], parameters=parameters)


class _Responses:
    """The responses of a decoupled BLS call, as they come. `cancel()` (Triton's response iterator's)
    cancels the call's request where it runs: a queued request never runs (the iterator ends with a
    CANCELLED error), a running model's is_cancelled() turns true, and what it still sends comes through
    until its final response (a CANCELLED error where it honours the cancellation), as in Triton.

    As Triton's iterator, it keeps the responses it gave: once the last one has come, iterating it again
    (`for` over it, after it was read to its end) gives them all again from the first; an iteration left
    midway resumes where it stopped, and `next()` after the end raises StopIteration."""

    def __init__(self, items: queue.Queue, uncall):
        self._items, self._uncall, self._cancelled = items, uncall, False
        self._given: list[pb.InferenceResponse] = []
        self._index = 0  # into _given, once the last response has come
        self._finished = False

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            self._uncall()

    def __iter__(self):
        if self._finished and self._index >= len(self._given):
            self._index = 0
        return self

    def __next__(self) -> pb.InferenceResponse:
        if not self._finished:
            item = self._items.get()
            if item is not _END:
                self._given.append(item)
                return item
            self._finished, self._index = True, len(self._given)
        if self._index < len(self._given):
            self._index += 1
            return self._given[self._index - 1]
        raise StopIteration


def _trace_ref(trace) -> tuple[int, int] | None:
    """Which request's trace parents a BLS call (`trace=request.trace()`); None: the execute's own."""
    return trace._ref if isinstance(trace, pb.InferenceTrace) else None


def _message(exc: BaseException) -> str:
    """What the caller reads: the exception's own words (its type when it has none), never a traceback."""
    if isinstance(exc, SystemExit):
        return f"model code raised SystemExit({exc.code!r})"
    if isinstance(exc, KeyboardInterrupt):
        return "model code raised KeyboardInterrupt"
    text = exc.message() if isinstance(exc, pb.TritonModelException) else str(exc)
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, pb.TritonModelException) and text else (
        text or type(exc).__name__)


def main(argv: list[str]) -> None:
    fd, arena_path, arena_bytes = int(argv[0]), argv[1], int(argv[2])
    sys.argv = sys.argv[:1]  # model code sees no arguments (as in Triton's stub): unittest.main() in a model parses them
    link = FrameSocket(socket.socket(fileno=fd))
    arena = Arena(Path(arena_path), arena_bytes, create=False) if arena_path else None
    host = Host(link, arena)
    host.forks = forks.Forks(host)
    pb.install(host)
    sys.modules["triton_python_backend_utils"] = pb
    threading.Thread(target=host.help_read, name="ferry-model-reader", daemon=True).start()
    host.serve()
    link.close()
    os._exit(0)  # model threads still running (a decoupled model's senders) end with the process


if __name__ == "__main__":
    main(sys.argv[1:])

"""The server's end of one model process: start it, talk to it, notice its death, end it.

The process runs `python -m server.backends.python.child` with one end of a socketpair and the path of
its arena (a /dev/shm file both map, unlinked once the child has mapped it). A reader thread here
takes every frame the child sends: answers go to the thread waiting for them (an instance thread
blocked on a queue, the GIL released), BLS calls, model control, metrics and log lines go to the
server (`Calls`). EOF means the process died: every call in flight is answered with the cause
("model process for 'm' exited with signal 11") and the backend starts a new process on its next call.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from concurrent.futures import Future
from typing import Callable, Protocol

import numpy as np

from server.backends.python import protocol as p
from server.ipc import tensors as ipc_tensors
from server.ipc.arena import SHM_DIR, Allocator, Arena
from server.ipc.frames import FrameSocket

log = logging.getLogger(__name__)
_ROOT = Path(__file__).resolve().parents[3]  # the folder holding the `server` package
_names = itertools.count()
_LOG_LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}


class Calls(Protocol):
    """What a model process asks of the server (server/runners/model_calls.py answers)."""

    def call(self, call: p.Call, inputs: dict[str, np.ndarray], answer: Callable, deadline_ns: int | None,
             parent=None) -> Future: ...
    def control(self, op: str, name: str, version: str, config: str, files: dict, answer: Callable) -> None: ...
    def metric(self, model: str, version: int, update: tuple) -> None: ...
    def restarted(self, model: str, version: int) -> None: ...


class ProcessDied(Exception):
    """The model process ended while a call was in flight; the message names the model and the cause."""


class ModelProcess:
    def __init__(self, model: str, version: int, arena_bytes: int, calls: Callable[[], Calls | None]):
        self.model, self.version, self.arena_bytes = model, version, arena_bytes
        self._calls = calls  # the server's handler, looked up when a frame needs it (bound after load)
        self._waiting: dict[int, queue.Queue] = {}  # call id -> where its answers go
        self._ids = itertools.count(1)
        self._blocks_lock = threading.Lock()
        self._freed: collections.deque[int] = collections.deque()  # blocks of the child's half seen to the last view
        self.death: str | None = None  # why the process ended, once it has
        self._checks: dict[int, Future] = {}  # is_ready() calls waiting for their answer
        self._check: Future | None = None  # the one in flight: later askers wait for its answer (as in Triton)
        self._check_lock = threading.Lock()
        self._deadlines: dict[int, int] = {}  # EXEC call -> its requests' deadline, which its BLS calls inherit
        self._made: dict[int, _Made] = {}  # EXEC or STREAM call -> its callers and the BLS calls it made
        self._bls: dict[int, Future] = {}  # decoupled BLS calls running, by the model's ref (UNCALL cancels one)
        self._traces: dict[int, list] = {}  # EXEC or STREAM call with a traced request -> its requests' traces
        self.took: collections.deque[int] = collections.deque(maxlen=8)  # what the last EXECs took the process
        self.proc: subprocess.Popen | None = None
        self.link: FrameSocket | None = None
        self.arena: Arena | None = None
        self._blocks: Allocator | None = None
        self._reader: threading.Thread | None = None
        self._loop = None  # the event loop the link is handed to (hand_over)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.arena, path = self._new_arena(), ""
        if self.arena is not None:
            path = str(self.arena.path)
            self._blocks = Allocator(0, self.arena.half)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "server.backends.python.child", str(theirs.fileno()), path,
                 str(self.arena.size if self.arena else 0)], pass_fds=(theirs.fileno(),), env=env,
                start_new_session=True)  # the server's Ctrl-C is not the model's: the server ends it
        finally:
            theirs.close()
        self.link = FrameSocket(ours)
        self._reader = threading.Thread(target=self._read, name=f"ferry-{self.model}-{self.proc.pid}", daemon=True)
        self._reader.start()

    def lower_priority(self, by: int) -> None:
        """Run the process `by` nice levels below the server. Linux's autogroups (on by default in most
        distributions) share the CPU between sessions first, whatever their processes' nice values, and a
        model process has a session of its own: so its nice value only orders it against itself, and it is
        its autogroup's that yields to the server. (Sharing the server's session instead, nice 10 kept a
        light model beside a spinning one at 0.57-0.67 of its requests/s; a session niced as a whole,
        0.75-0.96: bench/python_backend.py.) An autogroup's nice can be set once per 100 ms per machine
        without privileges: a busy moment is waited out. Linux keeps a nice value per thread, so each of
        the process's threads is lowered (those it starts later inherit it)."""
        nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + by)
        try:
            threads = [int(t.name) for t in Path(f"/proc/{self.pid}/task").iterdir()]
        except OSError:
            return  # the process ended meanwhile: its successor gets its own priority
        for thread in threads:
            with contextlib.suppress(ProcessLookupError):  # a thread (or the process) that ended meanwhile
                os.setpriority(os.PRIO_PROCESS, thread, nice)
        if _autogroup_nice(self.pid) is None:
            return  # no autogroups here (or the process ended): the nice value is the whole story
        # A server in the root autogroup (started from init's session, as in many containers) reads an
        # empty file; that group weighs as nice 0, and its model processes still get sessions of their own.
        want = min(19, (_autogroup_nice("self") or 0) + by)
        for _ in range(5):
            try:
                Path(f"/proc/{self.pid}/autogroup").write_text(str(want))
            except BlockingIOError:  # EAGAIN: some autogroup was set less than 100 ms ago
                time.sleep(0.11)
                continue
            except (FileNotFoundError, ProcessLookupError):
                return  # the process ended meanwhile
            except OSError as exc:
                reason = str(exc)
                break
            got = _autogroup_nice(self.pid)
            if got == want or self.proc.poll() is not None:
                return
            # A sandbox's /proc may take the write and keep nothing.
            reason = f"the kernel accepted nice {want} but shows {'no autogroup' if got is None else got}"
            break
        else:
            reason = "the kernel refused for 0.5 s: other autogroups kept being set"
        log.warning("model '%s': its process's autogroup priority could not be lowered (%s); only its nice value is",
                    self.model, reason)

    def _new_arena(self) -> Arena | None:
        if self.arena_bytes <= 0:
            return None
        path = SHM_DIR / f"ferry-model-{os.getpid()}-{next(_names)}"
        try:
            return Arena(path, self.arena_bytes, create=True)
        except OSError as exc:
            log.warning("model '%s': no shared memory arena (%s); its tensors travel inline", self.model, exc)
            return None

    def ask(self, frame_kind: str, *body, deadline_ns: int | None = None, callers: list = ()) -> tuple:
        """Send a frame that is answered once (INIT, AUTO, EXEC) and wait for the answer. `callers`: an
        EXEC's requests (InferRequests), followed as `follow` says."""
        call = next(self._ids) if frame_kind == p.EXEC else 0  # INIT and AUTO: one at a time, at start
        answers = self._wait_on(call)
        if deadline_ns is not None:
            self._deadlines[call] = deadline_ns
        self.follow(call, callers)
        self._traced(call, callers)
        try:
            if frame_kind == p.EXEC:
                self._send((frame_kind, call, *body, self._take_freed()))
            else:
                self._send((frame_kind, *body))
            answer = answers.get()
        finally:
            self._waiting.pop(call, None)
            self._deadlines.pop(call, None)
            self._made.pop(call, None)
            self._traces.pop(call, None)
        if isinstance(answer, ProcessDied):
            raise answer
        return answer

    def send(self, frame_kind: str, body, replied: Callable, deadline_ns: int | None = None, callers: list = ()) -> None:
        """Send an EXEC and return; `replied(answer or ProcessDied)` runs on the reader thread."""
        call = next(self._ids)
        if self.death is not None:
            replied(ProcessDied(self.death))
            return
        reply = self._expect(call, replied, deadline_ns, callers)
        if self.death is not None:  # it died between the check and the entry: the reader may have passed it
            reply.put(ProcessDied(self.death))
            return
        self._send((frame_kind, call, body, self._take_freed()))

    @property
    def execute_ns(self) -> int:
        """What an EXEC takes the process: the median of the last few (one slow execute, a model waiting
        on something, does not stop trains; a model slow every time does); 0 before any."""
        took = sorted(self.took)
        return took[len(took) // 2] if took else 0

    def send_train(self, requests: list[tuple], replied: Callable, callers: list) -> None:
        """Several executes of a model that does not batch, a request each, in one frame (EXECS): one write
        and at most one wake-up of the process for all of them, where each request alone costs both. Each
        is still a call of its own (its deadline, its caller leaving, its trace, its DONE);
        `replied([answer | ProcessDied])`, in order, once every one is answered."""
        if self.death is not None:
            replied([ProcessDied(self.death)] * len(requests))
            return
        train = _Train(len(requests), replied)
        execs, replies = [], []
        for i, (request, caller) in enumerate(zip(requests, callers)):
            call = next(self._ids)
            replies.append(self._expect(call, functools.partial(train.put, i), caller.deadline_ns, [caller]))
            execs.append((call, [request]))
        if self.death is not None:  # it died meanwhile: the reader may have passed these entries
            for reply in replies:
                reply.put(ProcessDied(self.death))
            return
        self._send((p.EXECS, execs, self._take_freed()))

    def _expect(self, call: int, replied: Callable, deadline_ns: int | None, callers: list) -> _Reply:
        """An EXEC call's one answer, to `replied` on the reader thread, with its deadline, callers and traces."""
        if deadline_ns is not None:
            self._deadlines[call] = deadline_ns
        self.follow(call, callers)
        self._traced(call, callers)
        reply = self._waiting[call] = _Reply(call, self._waiting, replied, self._deadlines, self._made, self._traces)
        return reply

    def open_streams(self, requests: list[tuple], sinks: list, traces: list) -> None:
        """Decoupled requests run by one execute: `sink.put((Reply | marker | None, final))` for each of a
        request's answers, or `sink.put(ProcessDied)`, on the reader thread or the event loop, until
        `close(sink.call)`; each `sink.call` is set before anything is sent (answers may come before this
        returns). `traces`: each request's, or None where it is not traced (its BLS calls' traces are its
        children). The BLS calls the execute makes are cancelled once every one of its callers has left."""
        if self.death is not None:
            raise ProcessDied(self.death)
        calls = []
        made = _Made(len(requests))
        for sink, trace in zip(sinks, traces):
            call = sink.call = next(self._ids)
            self._waiting[call] = sink
            self._made[call] = made
            if trace is not None:
                self._traces[call] = [trace]
            calls.append(call)
        if self.death is not None:  # it died meanwhile: the reader may have passed these entries
            for sink in sinks:
                sink.put(ProcessDied(self.death))
            return
        self._send((p.STREAM, calls, requests, self._take_freed()))

    def restream(self, call: int, request: tuple) -> None:
        """Run a decoupled request again under its call (the model rescheduled it): its answers keep
        coming to the same stream. A process that died meanwhile has answered the stream already."""
        self._send((p.STREAM, [call], [request], self._take_freed()))

    def close(self, call: int) -> None:
        """A stream is over (its final response came or its caller left, and its execute returned)."""
        self._waiting.pop(call, None)
        self._made.pop(call, None)
        self._traces.pop(call, None)

    def is_ready(self, timeout_s: float) -> bool:
        """The model's is_ready(), answered within `timeout_s` or taken as "not ready" (Triton's 5 s). A
        check asked while another is in flight waits for that one's answer (a slow is_ready is not asked
        again and again): so a check that timed out still answers the next asker when it returns."""
        with self._check_lock:
            check = self._check
            if check is None or check.done():
                ref, check = next(self._ids), Future()
                self._checks[ref], self._check = check, check
                self._send((p.CHECK, ref))
        try:
            return check.result(timeout=timeout_s) is True
        except TimeoutError:
            return False

    def cancel(self, call: int) -> None:
        """On the event loop: a stream's caller went away: tell the model (its request's is_cancelled());
        once every request of its execute has been left, the BLS calls that execute made are cancelled."""
        if call not in self._waiting:
            return
        self._send((p.CANCEL, call))
        made = self._made.get(call)
        if made is not None:
            made.callers -= 1
            if made.callers == 0:
                self._cancel_calls(made)

    def follow(self, call: int, callers: list) -> None:
        """Give each of an EXEC's requests a `caller_left` function (its runner calls it when the caller
        leaves while the request runs here): once every caller of the call has left, the model sees
        is_cancelled(), and the BLS calls it made are cancelled (a queued one never runs, a generation stops)."""
        if not callers:
            return
        made = self._made[call] = _Made(len(callers))

        def left() -> None:
            made.callers -= 1
            if made.callers == 0 and self._made.get(call) is made:
                self._cancel_made(call)

        for request in callers:
            request.caller_left = left

    def _traced(self, call: int, callers: list) -> None:
        """Keep the traces of an EXEC's requests while it runs, when one is traced: the BLS calls it
        makes are traced as their children (an untraced batch keeps nothing)."""
        for request in callers:
            if request.trace is not None:
                self._traces[call] = [r.trace for r in callers]
                return

    def _parent(self, call: int, given: tuple[int, int] | None):
        """The trace a BLS call made by EXEC or STREAM `call` is a child of: the request's that model code
        named (`trace=request.trace()`), else the call's first traced request's; None when untraced."""
        if not self._traces:
            return None
        if given is not None:
            traces = self._traces.get(given[0])
            return traces[given[1]] if traces is not None and 0 <= given[1] < len(traces) else None
        return next((t for t in self._traces.get(call, ()) if t is not None), None)

    def _cancel_made(self, call: int) -> None:
        """On the event loop: the EXEC call's callers are all gone."""
        made = self._made.get(call)
        if made is None or made.cancelled:
            return
        self._send((p.CANCEL, call))
        self._cancel_calls(made)

    @staticmethod
    def _cancel_calls(made: _Made) -> None:
        made.cancelled = True
        for future in list(made.calls):
            future.cancel()

    def _made_by(self, call: int, future) -> None:
        """A BLS call (a concurrent Future of the server's task running it) made for `call`."""
        made = self._made.get(call)
        if made is None:
            return
        if made.cancelled:  # made after its callers left: it never runs
            future.cancel()
            return
        made.calls.add(future)
        future.add_done_callback(made.calls.discard)

    def _wait_on(self, call: int) -> queue.Queue:
        """Where the call's answers go."""
        if self.death is not None:
            raise ProcessDied(self.death)
        answers = self._waiting[call] = queue.Queue()
        if self.death is not None:  # it died between the check and the entry: the reader may have passed it
            answers.put(ProcessDied(self.death))
        return answers

    def _send(self, frame: tuple) -> None:
        try:
            self.link.send(frame)
        except OSError:
            pass  # the reader sees the EOF and answers every waiting call with the cause

    def put(self, name: str, array: np.ndarray) -> tuple:
        """`array` written for the model process: a Tensor record as it travels (a plain tuple)."""
        with self._blocks_lock:
            return tuple(ipc_tensors.put(name, array, self.arena, self._blocks))

    def view(self, tensor: tuple) -> np.ndarray:
        return ipc_tensors.view(tensor, self.arena, self._free_theirs)

    def _free_theirs(self, offset: int) -> None:
        """A block of the child's half whose last view here is gone. It may run on any thread, inside a
        garbage collection that interrupted a send: so it only notes the block (deque.append is atomic),
        and the next EXEC or STREAM carries it (`_take_freed`)."""
        self._freed.append(offset)

    def _take_freed(self) -> list[int]:
        freed = []
        while self._freed:
            freed.append(self._freed.popleft())
        return freed

    def _free_ours(self, offsets: list[int]) -> None:
        with self._blocks_lock:
            for offset in offsets:
                self._blocks.free(offset)

    # ---- the reader thread
    def hand_over(self, loop) -> None:
        """On the event loop: have the link read and written by the loop from now on (the reader thread
        stops at the child's HANDOVER echo, so exactly one of them ever reads)."""
        if self._loop is None and self.death is None:
            self._loop = loop
            self._send((p.HANDOVER,))

    @property
    def on_loop(self) -> bool:
        return self.link is not None and self.link.attached

    def _read(self) -> None:
        link = self.link
        while (frame := link.recv()) is not None:
            if frame[0] == p.HANDOVER:
                try:
                    self._loop.call_soon_threadsafe(link.attach, self._loop, self._handle, self._lost)
                    return
                except RuntimeError:  # the loop is gone (the server is stopping): keep reading here
                    continue
            self._handle(frame)
        self._died()

    def _handle(self, frame: tuple) -> None:
        try:
            self._frame(frame)
        except Exception:  # one bad frame must not stop the model's answers
            log.exception("model '%s': a frame from its process could not be handled", self.model)

    def _lost(self) -> None:
        """On the loop: the link closed. Waiting for the process's status may take a moment: a thread does."""
        threading.Thread(target=self._died, name=f"ferry-{self.model}-exit", daemon=True).start()

    def _frame(self, frame: tuple) -> None:
        kind = frame[0]
        if kind == p.DONE and frame[3]:  # blocks of this side's half the child no longer reads
            self._free_ours(frame[3])
        if kind == p.DONE and len(frame) > 4 and frame[4]:
            self.took.append(frame[4])  # what the process spent on the call: a train is sized by it
        if kind in (p.DONE, p.RESPONSE):
            target = self._waiting.get(frame[1])
            if target is not None:
                target.put(frame[2] if kind == p.DONE else (frame[2], frame[3]))
        elif kind == p.CHECKED:
            target = self._checks.pop(frame[1], None)
            if target is not None:
                target.set_result(frame[2])
        elif kind in (p.READY, p.FAILED, p.AUTO):
            target = self._waiting.get(0)
            if target is not None:
                target.put(frame)
        elif kind == p.FREE:
            self._free_ours(frame[1])
        elif kind == p.UNCALL:
            self._uncall(frame[1])
        elif kind == p.LOG:
            log.log(_LOG_LEVELS.get(frame[1], logging.INFO), "model '%s': %s", self.model, frame[2])
        else:
            self._to_server(frame)

    def _to_server(self, frame: tuple) -> None:
        calls = self._calls()
        kind = frame[0]
        if kind == p.METRIC:
            try:
                if calls is not None:
                    calls.metric(self.model, self.version, frame[2:])
            finally:  # the model waits for this: an update is visible on /metrics once its call returns
                self._send((p.CALLED, frame[1], ([], None, {}), True))
            return
        ref = frame[1]

        def answer(outputs: dict | None = None, error: tuple[int, str] | None = None, final: bool = True,
                   parameters: dict | None = None) -> None:
            """On the event loop: the outputs written once into the server's half of the arena."""
            reply = None
            if outputs is not None or error is not None or parameters is not None:
                reply = ([self.put(n, a) for n, a in (outputs or {}).items()], error, parameters)  # a p.Reply
            self._send((p.CALLED, ref, reply, final))

        if calls is None:
            answer(None, (p.UNAVAILABLE, "the server cannot take calls from this model yet"))
        elif kind == p.CALL:
            call = p.record(p.Call, frame[2])
            made = calls.call(call, {t[0]: self.view(t) for t in call.inputs}, answer, self._deadlines.get(frame[3]),
                              self._parent(frame[3], call.trace))
            self._made_by(frame[3], made)
            if call.decoupled:  # model code may cancel it (UNCALL)
                self._bls[ref] = made
                made.add_done_callback(lambda _: self._bls.pop(ref, None))
        elif kind == p.CONTROL:
            calls.control(*frame[2:], answer)

    def _uncall(self, ref: int) -> None:
        """Model code cancelled a decoupled BLS call: its request is cancelled where it runs, as Triton's
        iterator cancel() does, and the responses still sent reach the iterator until its final one."""
        future = self._bls.get(ref)
        if future is not None:
            future.cancel_request()

    def _died(self) -> None:
        code = self.proc.wait()
        if code < 0:
            cause = f"exited with signal {-code} ({_signal_name(-code)})"
        else:
            cause = f"exited with exit code {code}"
        self.death = f"model process for '{self.model}' {cause}"
        for answers in list(self._waiting.values()):
            answers.put(ProcessDied(self.death))
        self.link.close()
        if self.arena is not None:
            self.arena.unlink()

    # ---- ending
    def stop(self, finalize_s: float) -> None:
        """finalize() and exit within `finalize_s`; killed past it (or at once when it is 0)."""
        if self.proc is None:
            return
        if finalize_s > 0 and self.death is None:
            self._send((p.FINALIZE,))
            try:
                self.proc.wait(finalize_s)
            except subprocess.TimeoutExpired:
                log.warning("model '%s': its process did not finish finalize within %.0f s; killed", self.model,
                            finalize_s)
        self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)
        if self.arena is not None:
            self.arena.unlink()


class _Made:
    """What an execute's callers leaving cancels: the BLS calls it made (shared by the STREAM calls of
    one execute)."""

    __slots__ = ("callers", "calls", "cancelled")

    def __init__(self, callers: int):
        self.callers, self.calls, self.cancelled = callers, set(), False


class _Train:
    """The answers of a train's executes, handed on together once the last has come."""

    __slots__ = ("answers", "left", "replied", "lock")

    def __init__(self, size: int, replied: Callable):
        self.answers, self.left, self.replied = [None] * size, size, replied
        self.lock = threading.Lock()  # answers come on the loop, a dead process's on a thread of its own

    def put(self, index: int, answer) -> None:
        with self.lock:
            self.answers[index] = answer[0] if answer.__class__ is list else answer  # an EXEC's one reply
            self.left -= 1
            done = self.left == 0
        if done:
            self.replied(self.answers)


class _Reply:
    """Where a sent call's one answer goes: a function, called on the reader thread (queue-like `put`)."""

    def __init__(self, call: int, waiting: dict, replied: Callable, deadlines: dict, made: dict, traces: dict):
        self.call, self.waiting, self.replied, self.deadlines, self.made = call, waiting, replied, deadlines, made
        self.traces = traces

    def put(self, answer) -> None:
        if self.waiting.pop(self.call, None) is not None:
            self.deadlines.pop(self.call, None)
            self.made.pop(self.call, None)
            self.traces.pop(self.call, None)
            self.replied(answer)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def _autogroup_nice(pid: int | str) -> int | None:
    """The nice value of a process's autogroup; None where there is none to read (no autogroups in the
    kernel, a process in the root autogroup shows an empty file, or it ended)."""
    try:
        text = Path(f"/proc/{pid}/autogroup").read_text()
        return int(text.split("nice")[1]) if "nice" in text else None
    except (OSError, ValueError):
        return None

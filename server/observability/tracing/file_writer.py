"""Triton's trace file, written by one thread as traces finish, never on the event loop.

Two ways, as Triton's settings choose:

- one file (`log_frequency` 0, no `trace_count`): `FILE` is one JSON array, appended to as traces
  finish. Each write overwrites the closing bracket and puts it back, so the file is a complete JSON
  array after every write, and after a clean stop (Triton writes it only at shutdown);
- indexed files: `FILE.0`, `FILE.1`, ... each a JSON array of `log_frequency` traces, or of the
  traces taken until `trace_count` ran out (`roll`); what is left at shutdown goes to the next index.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import IO, Callable

log = logging.getLogger(__name__)
_STOP = object()


@dataclass(slots=True)
class _File:
    """What the writer keeps per trace file path."""

    index: int = 0  # the next FILE.<index>
    pending: list[dict] = field(default_factory=list)  # entries of traces waiting for their indexed file
    pending_traces: int = 0
    stream: IO[str] | None = None  # the one-file way: FILE, open
    end: int = 0  # where the closing bracket of `stream` starts


class TraceFileWriter:
    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._files: dict[str, _File] = {}
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # starting the thread once
        self.written = 0  # traces written, for tests and logs

    def add(self, path: str, entries: list[dict] | Callable[[], list[dict]], log_frequency: int, indexed: bool) -> None:
        """A finished trace's entries for `path`, or the function that makes them (Trace.entries: called on the
        writer's thread, so tensors are formatted off the event loop); `indexed`: taken under a count."""
        self._start()
        self._queue.put(("add", path, entries, log_frequency, indexed))

    def roll(self, path: str) -> None:
        """The count ran out: write the traces waiting for `path` to its next indexed file."""
        self._start()
        self._queue.put(("roll", path, None, 0, True))

    def sync(self, timeout_s: float = 30) -> bool:
        """Wait until everything handed over so far is written (tests; a reader that wants the file now)."""
        self._start()
        done = threading.Event()
        self._queue.put(("sync", "", done, 0, False))
        return done.wait(timeout_s)

    def close(self) -> None:
        """Write what is left and close every file; returns once done."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join()
        self._thread = None

    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():  # everything that finished meanwhile, in one write per file
                items.append(self._queue.get())
            streamed: dict[str, list[dict]] = {}
            stop, synced = False, []
            for item in items:
                if item is _STOP:
                    stop = True
                elif item[0] == "sync":
                    synced.append(item[2])
                else:
                    self._handle(item, streamed)
            for path, entries in streamed.items():
                self._append(path, entries)
            for done in synced:
                done.set()
            if stop:
                self._finish()
                return

    def _handle(self, item, streamed: dict[str, list[dict]]) -> None:
        kind, path, entries, log_frequency, indexed = item
        state = self._files.setdefault(path, _File())
        try:
            if kind == "roll":
                self._write_indexed(path, state)
                return
            entries = entries() if callable(entries) else entries
            if log_frequency > 0 or indexed:
                state.pending.extend(entries)
                state.pending_traces += 1
                if log_frequency > 0 and state.pending_traces >= log_frequency:
                    self._write_indexed(path, state)
            else:
                streamed.setdefault(path, []).extend(entries)
                self.written += 1
        except Exception as exc:  # noqa: BLE001 - the writer thread must outlive any one trace
            log.error("trace file %s: %s; these traces are lost", path, exc)

    def _write_indexed(self, path: str, state: _File) -> None:
        if not state.pending:
            return
        target = f"{path}.{state.index}"
        state.index += 1
        entries, traces = state.pending, state.pending_traces
        state.pending, state.pending_traces = [], 0
        with open(target, "w", encoding="utf-8") as f:
            json.dump(entries, f)
        self.written += traces

    def _append(self, path: str, entries: list[dict]) -> None:
        state = self._files.setdefault(path, _File())
        try:
            text = ",\n".join(json.dumps(e) for e in entries)
            if state.stream is None:
                state.stream = open(path, "w", encoding="utf-8")
                state.stream.write("[\n")
            else:
                state.stream.seek(state.end)
                state.stream.write(",\n")
            state.stream.write(text)
            state.end = state.stream.tell()
            state.stream.write("\n]\n")
            state.stream.flush()
        except OSError as exc:
            log.error("trace file %s: %s; these traces are lost", path, exc)

    def _finish(self) -> None:
        for path, state in self._files.items():
            try:
                self._write_indexed(path, state)
                if state.stream is not None:
                    state.stream.close()
            except OSError as exc:
                log.error("trace file %s: %s", path, exc)

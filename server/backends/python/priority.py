"""How much of the CPU a model process yields to the server: fixed by the model's config, or judged by what
the model does.

Where cores are few, a model that computes in Python shares them with the server's event loop (every
model's front door) and with the ONNX and PyTorch models running inside the server. At equal
priority a model spinning in pure Python took half the requests/s of a light model beside it on 2
cores (bench/python_backend.py). Lowering every model process instead costs light ones: add_sub at 64
clients made 0.87 of its requests/s with its process at nice 10, because each short call then waits
behind the server's threads for a core. So by default (`auto`) a process starts at the server's
priority and is lowered once it shows it is heavy: over a second of answers, it kept at least half a
core busy and spent at least HEAVY_CALL_MS of CPU per call. A light model (add_sub: ~0.1 ms a call)
never gets near that; a model whose calls hold a core for a scheduler time slice or more does. It
stays lowered until its process is replaced (a process's own nice cannot be raised again without
privileges a server should not hold). The CPU is read from /proc once a second at most, on an answer:
nothing is added to a light model's calls.

`FERRY_PROCESS_NICE` 0-19 fixes it instead (0: never lowered).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from server.errors import ConfigError

log = logging.getLogger(__name__)
PARAMETER = "FERRY_PROCESS_NICE"  # config parameter: "auto" (default) or the nice levels below the server, 0-19
AUTO = "auto"
AUTO_NICE = 10  # how far a heavy model is lowered (a light model beside a spinner kept 0.70-0.96
# of its requests/s with the spinner at 10, 0.51-0.77 with it at the server's priority; 19 did no better)
HEAVY_CALL_MS = 20.0  # CPU per call from which a model counts as heavy (about a scheduler time slice)
BUSY_SHARE = 0.5  # ... when it also keeps this share of a core busy
CHECK_S = 1.0  # the shortest span judged
_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def parse(model: str, given: str | None) -> int | None:
    """The fixed nice levels below the server that the config asks, or None for `auto`."""
    if given is None or given.strip().lower() == AUTO:
        return None
    try:
        value = int(given)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ConfigError(f"model '{model}': parameter {PARAMETER} is {given!r}; use 'auto' (the default) or an "
                          "integer from 0 (the server's priority) to 19 (the lowest)")
    return value


class Priority:
    """One model instance's process priority, kept across the processes that serve it."""

    def __init__(self, model: str, fixed: int | None):
        self.model, self.fixed = model, fixed
        self._process = None
        self._calls = 0
        self._since: tuple[float, float, int] | None = None  # (monotonic s, process CPU ms, calls) of the span
        self._next = 0.0  # when the span may be judged
        self._judged = True  # nothing left to decide (fixed, or lowered) until the next process
        self._judging = threading.Lock()

    def started(self, process) -> None:
        """A new process serves the model (first start or restart): it gets the fixed priority, or starts
        at the server's and is judged afresh."""
        self._process, self._calls, self._since, self._next = process, 0, None, 0.0
        self._judged = self.fixed is not None
        if self.fixed:
            process.lower_priority(self.fixed)

    def answered(self) -> None:
        """A call was answered (on the event loop or an instance thread): at most once a second, judge the
        span since the last look."""
        self._calls += 1
        if self._judged or time.monotonic() < self._next or not self._judging.acquire(blocking=False):
            return
        try:
            self._judge()
        finally:
            self._judging.release()

    def _judge(self) -> None:
        now, process = time.monotonic(), self._process
        cpu = _cpu_ms(process.pid)
        if cpu is None:  # gone: the next process is judged from its own first answer
            self._judged = True
            return
        if self._since is None:  # the first answer: spans start here, so importing and initialize never count
            self._since, self._next = (now, cpu, self._calls), now + CHECK_S
            return
        then, then_cpu, then_calls = self._since
        spent, calls, span_ms = cpu - then_cpu, self._calls - then_calls, (now - then) * 1000
        self._since, self._next = (now, cpu, self._calls), now + CHECK_S
        if spent >= BUSY_SHARE * span_ms and spent >= HEAVY_CALL_MS * max(calls, 1):
            self._judged = True  # for the life of this process
            log.info("model '%s': its process (pid %d) spent %.0f ms of CPU per call over the last %.1f s; its CPU "
                     "priority is lowered by %d so the server and lighter models come first (parameter %s pins it)",
                     self.model, process.pid, spent / max(calls, 1), span_ms / 1000, AUTO_NICE, PARAMETER)
            # Not on the caller's thread, which may be the event loop: the kernel can ask for a short wait.
            threading.Thread(target=process.lower_priority, args=(AUTO_NICE,), name=f"ferry-{self.model}-nice",
                             daemon=True).start()


def _cpu_ms(pid: int | None) -> float | None:
    """User and system CPU of the whole process (every thread) so far, in ms; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) * _TICK_MS

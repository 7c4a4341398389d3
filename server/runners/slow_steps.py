"""Generation steps far slower than their cost model predicts, named in the log with where the time went.

A stalled step is an inter-token stall for every stream in it. Whether the step computed that long or
waited (for a core the machine gave to something else, for the event loop to pick up its result) says
what to change, so the step thread's own CPU time and the loop's delay are measured with each step:
CPU time near the step's wall time means it computed; far below, it waited. Reported at most once per
INTERVAL_S per model, with the count of slow steps since the last report, so a slow machine does not
flood the log. A clock read and one getrusage call before and after each step are all it costs.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)
SLOW_MS = 250.0  # a step at least this long ...
FACTOR = 4.0  # ... and this many times its predicted cost is reported
INTERVAL_S = 30.0
_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux: this thread's own counters


@dataclass(slots=True)
class StepTiming:
    """What the step thread saw of one step: its wall time (ns), its own CPU time split into user and
    system (s), its page faults and its involuntary context switches (the kernel took its core)."""

    wall_ns: int
    user_s: float = 0.0
    system_s: float = 0.0
    faults: int = 0
    preempted: int = 0

    @property
    def cpu_ms(self) -> float:
        return (self.user_s + self.system_s) * 1e3


def _usage():
    return resource.getrusage(_THREAD) if _THREAD is not None else None


def timed(run, *args):
    """In the step thread: `run(*args)` and its StepTiming."""
    wall, before = time.monotonic_ns(), _usage()
    result = run(*args)
    timing = StepTiming(time.monotonic_ns() - wall)
    after = _usage()
    if after is not None:
        timing.user_s, timing.system_s = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
        timing.faults = after.ru_minflt - before.ru_minflt + after.ru_majflt - before.ru_majflt
        timing.preempted = after.ru_nivcsw - before.ru_nivcsw
    return result, timing


class SlowSteps:
    def __init__(self, model: str, interval_s: float = INTERVAL_S):
        self.model, self.interval_s = model, interval_s
        self.unreported = 0
        self._next_report = 0.0

    def check(self, elapsed_ns: int, predicted_ms: float, timing: StepTiming, tokens: int, sequences: int) -> bool:
        """Whether this step (`elapsed_ns` from plan to results on the loop) was a slow one; logs it when a
        report is due."""
        ms = elapsed_ns / 1e6
        if ms < SLOW_MS or (predicted_ms > 0 and ms < FACTOR * predicted_ms):
            return False
        self.unreported += 1
        now = time.monotonic()
        if now < self._next_report:
            return True
        self._next_report = now + self.interval_s
        thread_ms, cpu_ms = timing.wall_ns / 1e6, timing.cpu_ms
        more = f"; {self.unreported - 1} more slow steps since the last report" if self.unreported > 1 else ""
        log.warning("model '%s': a generation step took %.0f ms, predicted %.0f ms (%d tokens, %d sequences): "
                    "%.0f ms in the step thread, %.0f ms of it on a CPU (%.0f user, %.0f system; %s), %d page faults, "
                    "%d times preempted; %.0f ms on the event loop around it (planning, then taking the result)%s",
                    self.model, ms, predicted_ms, tokens, sequences, thread_ms, cpu_ms, timing.user_s * 1e3,
                    timing.system_s * 1e3,
                    "computing" if cpu_ms >= 0.5 * thread_ms else "mostly waiting: the machine's cores were busy elsewhere",
                    timing.faults, timing.preempted, max(0.0, ms - thread_ms), more)
        self.unreported = 0
        return True

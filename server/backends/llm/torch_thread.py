"""One thread for every generation model's torch work on the CPU: loads and steps alike.

torch's OpenMP runtime (libgomp on Linux) keeps a team of worker threads for each thread that opens a
parallel region, and once the process holds more of them than it has CPUs it stops letting them spin
between regions (~100 spins, then sleep). Every parallel region of a step then wakes its sleeping
worker, and the kernel tends to place the woken worker on the waking thread's own core. Measured on a
2-core machine (the issue-33 benchmark model, 200-token prefill): with the model loaded on one
thread and stepped on another, ~150 involuntary switches per step and 1.3-1.9x its time after the
server had been idle for a moment, which is when a request's first step runs. One thread for the
load and every step of every model on the CPU keeps the process at one team.

The price is that CPU models step one at a time; each step already spreads over every core, so two
at once would only fight over them. On CUDA each model keeps a step thread of its own: its work is
the device's, and models overlap there.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from server.backends.base import Device

T = TypeVar("T")
_NAME = "ferry-cpu-torch"
_lock = threading.Lock()
_shared: ThreadPoolExecutor | None = None


def shared() -> ThreadPoolExecutor:
    """The process's CPU torch thread (started on first use; never shut down: models come and go)."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = ThreadPoolExecutor(max_workers=1, thread_name_prefix=_NAME)
        return _shared


def run(device: Device, fn: Callable[[], T]) -> T:
    """`fn()` on the CPU torch thread for a CPU device (inline when already there), else right here."""
    if device.kind != "cpu" or threading.current_thread().name.startswith(_NAME):
        return fn()
    return shared().submit(fn).result()


def step_thread(device: Device, name: str) -> tuple[ThreadPoolExecutor, bool]:
    """The thread a model's steps run on, and whether the caller owns it (and so shuts it down)."""
    if device.kind == "cpu":
        return shared(), False
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name), True

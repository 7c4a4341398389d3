"""One thread for every generation model's torch work on the CPU: loads and steps alike.

torch's OpenMP runtime (libgomp on Linux) keeps a team of worker threads for each thread that opens a
parallel region, and once the process holds more of them than it has CPUs it lets them spin only
~100 times between regions before they sleep; each parallel region then wakes a sleeping worker,
which the kernel tends to place on the waking thread's own core. That is the likely reading of what
was measured on a 2-core machine (the issue-33 benchmark model served, a 200-token prompt every 0.3 s
so the server idles between them): ~150 involuntary context switches per prefill step with the model
loaded on one thread and stepped on another, and time to first token 90-99 ms against 67-76 ms with
load and steps on this one thread (three interleaved rounds of eight). Without the server the same
switches came and went with the machine's state whichever thread ran what, so the mechanism is not
proven; the served difference held in every round.

The price: CPU models step one at a time, and a CPU model's load holds up the other CPU models' steps
until it is done. Each step already spreads over every core, so two at once would only fight over
them. On CUDA each model keeps a step thread of its own: its work is the device's, and models overlap
there.
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

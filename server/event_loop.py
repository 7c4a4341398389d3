"""Which asyncio event loop runs a Ferry process: uvloop where it is installed, asyncio's own otherwise.

On a light model the event loop, not the model, bounds throughput: every request's gRPC decode,
dispatch and encode runs on it (docs/tuning.md). grpc.aio drives the loop through a few callbacks and
one file-descriptor wake-up per request, and uvloop runs that machinery in C (libuv) where asyncio's
own loop runs it in Python: bench/hotpath.py measured 0.85x the loop's CPU per request with uvloop on
the same code, as vLLM and uvicorn found for their front ends. The engine and every front-end
process (--frontend-processes) run on the loop chosen here; `asyncio` stays selectable for platforms
uvloop does not serve (Windows) and for comparing the two.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

AUTO, UVLOOP, ASYNCIO = "auto", "uvloop", "asyncio"
CHOICES = (AUTO, UVLOOP, ASYNCIO)

T = TypeVar("T")


class EventLoopUnavailable(RuntimeError):
    pass


def loop_factory(choice: str = AUTO) -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes the loop `choice` names; `auto` takes uvloop when it imports."""
    if choice not in CHOICES:
        raise ValueError(f"event loop must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice != ASYNCIO:
        try:
            import uvloop
        except ImportError as exc:
            if choice == UVLOOP:
                raise EventLoopUnavailable(f"--event-loop uvloop: uvloop is not installed here ({exc}); "
                                           "`pip install uvloop`, or use --event-loop asyncio") from exc
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: str = AUTO) -> T:
    """`asyncio.run(main)` on the loop `choice` names."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)


def name(loop: asyncio.AbstractEventLoop) -> str:
    """What the startup log says the process runs on."""
    module = type(loop).__module__.split(".")[0]
    if module == UVLOOP:
        import uvloop

        return f"uvloop {uvloop.__version__}"
    return ASYNCIO

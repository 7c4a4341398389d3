"""Choosing the event loop (server/event_loop.py) and measuring its load (server/observability/loop_load.py) on each kind."""

from __future__ import annotations

import asyncio
import sys

import pytest

from server import event_loop
from server.observability.loop_load import LoopLoad
from tests.conftest import wait_for_async


def test_auto_takes_uvloop_and_asyncio_stays_selectable():
    import uvloop

    assert event_loop.loop_factory("auto") is uvloop.new_event_loop
    assert event_loop.loop_factory("uvloop") is uvloop.new_event_loop
    assert event_loop.loop_factory("asyncio") is asyncio.new_event_loop
    assert event_loop.run(_loop_name(), "auto").startswith("uvloop ")
    assert event_loop.run(_loop_name(), "asyncio") == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused_with_a_way_out(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what `import uvloop` meets where it is not installed
    assert event_loop.loop_factory("auto") is asyncio.new_event_loop
    with pytest.raises(event_loop.EventLoopUnavailable, match="--event-loop asyncio"):
        event_loop.loop_factory("uvloop")


def test_an_unknown_loop_is_refused():
    with pytest.raises(ValueError, match="auto, uvloop, asyncio"):
        event_loop.loop_factory("trio")


async def _loop_name() -> str:
    return event_loop.name(asyncio.get_running_loop())


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_loop_load_tells_an_idle_loop_from_a_busy_one(kind):
    """Counts, not durations: the loop sleeps through three measured intervals, then keeps its thread
    busy through three more. A busy thread that waits for a core still counts as busy, so a loaded
    machine cannot make the busy loop look idle; the idle loop wakes only every 0.1 s (its timer and the
    poll), so even a wait of tens of ms for a core at each wake-up keeps it well under half busy."""

    async def scenario():
        load = LoopLoad(asyncio.get_running_loop(), interval_s=0.1)
        await wait_for_async(lambda: load.intervals >= 3, 60, "three idle intervals", poll_s=0.1)
        idle = load.busy_ratio
        start = load.intervals
        while load.intervals < start + 3:
            sum(range(20_000))  # CPU work between the loop's callbacks; the timer still fires
            await asyncio.sleep(0)
        busy = load.busy_ratio
        load.close()
        return idle, busy

    idle, busy = event_loop.run(asyncio.wait_for(scenario(), 120), kind)
    assert 0.0 <= idle < 0.5
    assert 0.5 < busy <= 1.0

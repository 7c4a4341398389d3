"""A test launcher: Ferry's own server, which answers SIGUSR1 by writing how many objects of each
class are alive (after a full collection) to the file named by FERRY_LIVE_OBJECTS, as JSON.

Tests that must show that nothing outlives its request (cancelled streams, failed batches) count the
server's request and sequence objects with it, rather than judging by memory, which the allocator
keeps for the next peak. Serve with `python -m tests.live_objects serve ...`.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import signal
from pathlib import Path


def _name(o) -> str:
    return f"{type(o).__module__}.{type(o).__qualname__}"


def _describe(o) -> str:
    if isinstance(o, dict):
        return f"dict with keys {list(o)[:6]}"
    if type(o).__name__ == "frame":
        return f"frame {o.f_code.co_name} ({o.f_code.co_filename}:{o.f_lineno})"
    if type(o).__name__ in ("function", "method", "cell"):
        return f"{type(o).__name__} {getattr(o, '__qualname__', '')}"
    return _name(o)


def _holders(o, depth: int, seen: set) -> list:
    """What keeps `o` alive, `depth` referrers deep (the frames of this handler left out)."""
    if depth == 0:
        return []
    out = []
    for r in gc.get_referrers(o):
        if id(r) in seen or r is seen or type(r).__name__ == "frame" and r.f_code.co_name in ("_write", "_holders"):
            continue
        seen.add(id(r))
        out.append([_describe(r), _holders(r, depth - 1, seen)])
    return out[:8]


def _write(*_) -> None:
    gc.collect()
    objects = gc.get_objects()
    counts = collections.Counter(_name(o) for o in objects)
    traced = set(filter(None, os.environ.get("FERRY_LIVE_TRACE", "").split(",")))
    if traced:  # what holds the objects of these classes: for a failing test's message
        counts["holders"] = [_holders(o, 4, {id(objects)}) for o in objects if _name(o) in traced][:3]
    del objects
    path = Path(os.environ["FERRY_LIVE_OBJECTS"])
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(counts, default=str))
    partial.replace(path)  # whole or absent: the test never reads half a file


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _write)
    from server.__main__ import main

    main()

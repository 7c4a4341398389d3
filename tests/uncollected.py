"""A test launcher: Ferry's own server with Python's cycle collector off. SIGUSR1 makes it write, without
a collection, how many InferRequests of each model are alive to the file named by FERRY_LIVE_OBJECTS,
as JSON ({model name: count}).

What only the cycle collector frees lives until it happens to run, and the server runs it rarely
(server/heap.py): a request caught in a reference cycle keeps its tensors that long. With the collector
off, such a request stays in the count for good, so a test can tell "freed when its last reference went"
from "freed some time later" without waiting for anything. Serve with `python -m tests.uncollected serve ...`.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import signal
from pathlib import Path


def _write(*_) -> None:
    from server.request import InferRequest

    counts = collections.Counter(o.model_name for o in gc.get_objects() if isinstance(o, InferRequest))
    path = Path(os.environ["FERRY_LIVE_OBJECTS"])
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(counts))
    partial.replace(path)  # whole or absent: the test never reads half a file


if __name__ == "__main__":
    gc.disable()  # the server's own gc.collect() at startup (heap.park) still runs; nothing collects later
    signal.signal(signal.SIGUSR1, _write)
    from server.__main__ import main

    main()

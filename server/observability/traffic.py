"""`ferry serve --record-traffic FILE`: one JSON line per admitted request, for `ferry tune --from-trace`.

Each line is what a replay needs to send the same load again: the model, when the request arrived
(seconds since the recording started, on the monotonic clock) and its size, either the shape of each
input (an infer request) or the prompt's token count and the tokens asked for (a generation). Tensor
contents are not kept: they may be private, and the tuner only needs their shapes (`--input-data`
supplies real values). Lines are appended, so a file can collect several runs; each run's first line
is a `{"start": ...}` marker, and a reader takes the last run.

The recorder is process-wide (one file per server), set once at start, and does nothing unless set.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

_recorder: TrafficRecorder | None = None


class TrafficRecorder:
    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "a", buffering=1 << 16, encoding="utf-8")  # held until close()
        self._t0 = time.monotonic_ns()
        self._lock = threading.Lock()  # front-end threads and the loop may both write
        self._write({"start": time.time()})

    def _write(self, line: dict) -> None:
        text = json.dumps(line, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(text)

    def infer(self, model: str, arrival_ns: int, shapes: dict[str, tuple[int, ...]]) -> None:
        self._write({"model": model, "t": round((arrival_ns - self._t0) / 1e9, 6),
                     "inputs": {name: list(shape) for name, shape in shapes.items()}})

    def generate(self, model: str, arrival_ns: int, prompt_tokens: int, max_tokens: int) -> None:
        self._write({"model": model, "t": round((arrival_ns - self._t0) / 1e9, 6),
                     "prompt_tokens": prompt_tokens, "max_tokens": max_tokens})

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def start(path: Path) -> TrafficRecorder:
    global _recorder
    _recorder = TrafficRecorder(path)
    return _recorder


def stop() -> None:
    global _recorder
    if _recorder is not None:
        _recorder.close()
        _recorder = None


def infer(model: str, arrival_ns: int, inputs: dict) -> None:
    if _recorder is not None:
        _recorder.infer(model, arrival_ns, {name: array.shape for name, array in inputs.items()})


def generate(model: str, arrival_ns: int, prompt_tokens: int, max_tokens: int) -> None:
    if _recorder is not None:
        _recorder.generate(model, arrival_ns, prompt_tokens, max_tokens)


def flush() -> None:
    if _recorder is not None:
        _recorder.flush()

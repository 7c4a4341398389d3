"""`preserve_ordering`: answers leave in the order requests were admitted, even when batches finish out of order."""

from __future__ import annotations

from typing import Callable

from server.request import InferRequest


class ResponseOrder:
    def __init__(self):
        self._waiting: dict[InferRequest, Callable[[], None] | None] = {}  # insertion order = admission order

    def admit(self, request: InferRequest) -> None:
        self._waiting[request] = None

    def finish(self, request: InferRequest, settle: Callable[[], None]) -> None:
        """Record how to answer `request`; answer it and every later one whose turn has come."""
        if request not in self._waiting:
            settle()
            return
        self._waiting[request] = settle
        while self._waiting:
            first = next(iter(self._waiting))
            ready = self._waiting[first]
            if ready is None:
                return
            del self._waiting[first]
            ready()

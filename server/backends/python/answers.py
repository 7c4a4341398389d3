"""The answers of one batch of a model that is not decoupled, in the model process.

Triton lets such a model answer a request in either of two ways: the response `execute` returns for
it, or its response sender (one response, then TRITONSERVER_RESPONSE_COMPLETE_FINAL, sent before or
after execute returns, from any thread). Whichever comes first is the request's answer; the batch is
answered once every request has one. The rules and messages are Triton's (its QA suite's
response_sender tests): a second response, or the final flag before any response, is refused.
"""

from __future__ import annotations

import threading
from typing import Callable

from server.backends.python import pb_utils as pb
from server.backends.python import protocol as p

NO_RESPONSE_YET = "Non-decoupled model cannot send complete final before sending a response"
SECOND_RESPONSE = "Non-decoupled model cannot send more than one response"
CLOSED = pb.SENDER_CLOSED


class Batch:
    """One answer per request, each from execute's return or from the request's response sender."""

    def __init__(self, size: int, reply: Callable[[object], p.Reply]):
        self.replies: list[p.Reply | str | None] = [None] * size
        self._reply = reply  # an InferenceResponse (or what execute returned) as the frame's Reply
        self._senders: set[int] = set()  # requests whose sender model code took: their answer may come later
        self._closed: set[int] = set()  # requests whose sender sent the final flag
        self._returned = False
        self._lock = threading.Lock()

    def complete(self) -> bool:
        with self._lock:
            return self._returned and all(r is not None for r in self.replies)

    def took_sender(self, index: int) -> None:
        with self._lock:
            self._senders.add(index)

    def returned(self, responses: list) -> None:
        """What execute returned: an answer for each request the sender did not answer (a response it
        returned for one that was answered already is dropped, as Triton drops it). A request with
        neither a response nor a sender taken gets the error of a missing response."""
        with self._lock:
            for i, response in enumerate(responses):
                if self.replies[i] is not None or (response is None and i in self._senders):
                    continue
                self.replies[i] = response if isinstance(response, (str, p.Reply)) else self._reply(response)
            self._returned = True

    def failed(self, reply: p.Reply) -> None:
        """execute raised: the requests not answered yet get its error; the others keep their answer."""
        with self._lock:
            self.replies = [reply if r is None else r for r in self.replies]
            self._returned = True

    def send(self, index: int, response: pb.InferenceResponse | None, final: bool) -> None:
        with self._lock:
            if index in self._closed:
                raise pb.TritonModelException(CLOSED)
            if response is not None:
                if self.replies[index] is not None:
                    raise pb.TritonModelException(SECOND_RESPONSE)
                self.replies[index] = self._reply(response)
            elif final and self.replies[index] is None:
                raise pb.TritonModelException(NO_RESPONSE_YET)
            if final:
                self._closed.add(index)


class Sender:
    """`request.get_response_sender()` of a request that is not decoupled: one response, then final."""

    def __init__(self, batch: Batch, index: int, answered: Callable[[], None], cancelled: Callable[[], bool]):
        self._batch, self._index, self._answered, self._cancelled = batch, index, answered, cancelled
        batch.took_sender(index)

    def send(self, response: pb.InferenceResponse | None = None, flags: int = 0) -> None:
        self._batch.send(self._index, response, bool(flags & pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL))
        self._answered()

    def is_cancelled(self) -> bool:
        return self._cancelled()

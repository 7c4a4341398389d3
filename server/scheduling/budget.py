"""Memory bounded in bytes: what admitted requests hold, against a limit per model and one for the server.

A queue bounded only in requests is not bounded in memory: 10,000 requests of 2 GiB each fit the
default limits. Each request's input bytes are taken from its model's budget and from the server's
when it is admitted and given back when it is answered, so the bytes held by queued and running
requests never exceed either limit. A request that does not fit is refused at once, as a full queue
is (UNAVAILABLE: the client may retry, here later or on another replica).
"""

from __future__ import annotations

from server.errors import QueueFullError


class ByteBudget:
    def __init__(self, limit: int, name: str, parent: ByteBudget | None = None):
        self.limit = limit  # 0: no limit of its own
        self.name = name  # as the refusal names it: "model 'x'" or "the server"
        self.parent = parent
        self.held = 0

    def take(self, nbytes: int) -> None:
        """Hold `nbytes` here and in every parent, or raise QueueFullError and hold nothing."""
        budget = self
        while budget is not None:
            if budget.limit and budget.held + nbytes > budget.limit:
                raise QueueFullError(
                    f"{budget.name} holds {_mib(budget.held)} of queued request data and its limit is "
                    f"{_mib(budget.limit)}: this request's {_mib(nbytes)} does not fit now; retry later")
            budget = budget.parent
        budget = self
        while budget is not None:
            budget.held += nbytes
            budget = budget.parent

    def give(self, nbytes: int) -> None:
        budget = self
        while budget is not None:
            budget.held -= nbytes
            budget = budget.parent


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"

"""The drain state every front door consults: once the server shuts down, new calls are refused.

One object for all doors, so `quiet()` (have callers moved away?) counts refusals from gRPC and HTTP
alike; each door only says how a refusal looks on its wire (UNAVAILABLE, 503).
"""

from __future__ import annotations

import asyncio
import time

SHUTTING_DOWN = "server is shutting down; retry on another replica"


class Drain:
    def __init__(self):
        self.closed = False
        self._last_refused = 0.0  # time.monotonic() of the latest refused call
        self.refused = 0  # calls refused while draining, for the log

    def close(self) -> None:
        """From now on every call but a probe is refused."""
        self.closed = True
        self._last_refused = time.monotonic()

    def refuse(self) -> None:
        """A door refused one call because the server is draining."""
        self._last_refused = time.monotonic()
        self.refused += 1

    async def quiet(self, quiet_s: float, timeout_s: float) -> bool:
        """Wait until no call has been refused for `quiet_s` (clients have moved away), at most `timeout_s`.

        Stopping a door cancels calls that reach it while it stops, so it is stopped once callers have
        left: gRPC clients that watch grpc.health.v1 leave as soon as they read NOT_SERVING; others keep
        arriving and are refused until the grace runs out."""
        deadline = time.monotonic() + timeout_s
        while (now := time.monotonic()) < deadline:
            idle = now - self._last_refused
            if idle >= quiet_s:
                return True
            await asyncio.sleep(min(quiet_s - idle, deadline - now))
        return False
